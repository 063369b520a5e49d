"""Contract tests of the SGLang adapter (see conftest.py)."""

SKIP_REASON = ("needs the real sglang wheel: run `make test-sglang` "
               "(ci/setup_sglang_cpu.sh builds .venv-sglang)")
