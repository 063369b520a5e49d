"""The field report replayed on NVIDIA Dynamo itself (``python -m bench.dynamo``, in the
Dynamo environment): :mod:`.run` runs one arm, :mod:`.result` every arm and writes
``bench/results/dynamo_replay.json``."""
