"""Decoding: the one request path (pipeline.py: encode -> heal -> stop rule -> stream -> engine), the
engine (engine.py: propose -> verify -> accept -> commit; without a proposer, plain decoding), the
reference decoder (reference.py), the proposer protocol (protocol.py), acceptance rules (verify.py),
sampling, stopping, trees, `-k auto` with its cost model and calibration, and the metrics. Knows no
particular proposer."""
