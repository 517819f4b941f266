"""Decoding: plain (decode.py, reference.py) and speculative (engine.py: propose -> verify -> accept ->
commit), the proposer protocol (protocol.py), acceptance rules (verify.py), sampling, stopping, trees,
`-k auto` with its cost model and calibration, and the metrics. Knows no particular proposer."""
