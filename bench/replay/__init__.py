"""The field report replayed with aiperf: NVIDIA's own load generator (``aiperf profile``,
``ci/setup_aiperf.sh``) sends a seeded mooncake trace to reference workers behind a
router while one worker is scaled down, and every request is judged from aiperf's raw
export (:mod:`bench.replay.judge`), not from aiperf's own success count, which takes an
HTTP 200 stream that ended in an error event for a success.
"""
