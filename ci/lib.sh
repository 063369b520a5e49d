# Shared by the ci/setup_*.sh scripts. Source it once REPO (the checkout), PY (the
# environment's python) and, for editable_install, SOURCES_FILE are set.

# pip's machine config adds local file indexes that hold only some projects; pip warns
# once per project it does not find there. Drop that noise, keep every other message.
# Installs byte-compile (pip's default): these machines set PYTHONDONTWRITEBYTECODE, so a
# module left uncompiled would be compiled again by every process that imports it.
pip_() {
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# quiesce's modules, one per line: the strict editable install links each one, so a new
# module needs a reinstall (the scripts compare this list with SOURCES_FILE).
sources() {
    (cd "$REPO" && shopt -s nullglob &&
        printf '%s\n' core/*.py core/*/*.py adapters/*.py adapters/*/*.py | LC_ALL=C sort)
}

# quiesce itself, without dependencies (it has none), in strict editable mode.
editable_install() {
    pip_ install --quiet --no-deps --config-settings editable_mode=strict -e "$REPO"
    sources >"$SOURCES_FILE"
}
