"""The language model: its architecture (arch.py) and transformer (model.py), its cache, checkpoints,
tokenizer and chat template, transformers models admitted through an adapter, and the interface the
decoding layer needs of any causal LM (interface.py). Knows nothing about drafting or verification."""
