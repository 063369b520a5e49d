"""``python -m bench.dynamo [ARM ...]``: run the Dynamo replay (every arm by default) and
write ``bench/results/dynamo_replay.json``. Runs in the Dynamo environment
(``.venv-dynamo/bin/python -m bench.dynamo``; ``make bench`` does)."""

from __future__ import annotations

import sys

from bench.dynamo import result
from bench.results_format import run_and_report

if __name__ == "__main__":
    arms = sys.argv[1:] or None
    run_and_report(result.NAME, lambda: result.run(arms), result.HEADLINE)
