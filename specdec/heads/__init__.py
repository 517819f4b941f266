"""The trainable draft heads, each with its checkpoint folder: one definition, used by training
(train/) and by the drafters that run them (proposers/).

mtp.py: multi-token prediction heads on the trunk's final hidden state; eagle.py: an EAGLE-3 head on
the target's layer features; block.py: a block head that drafts k tokens in one forward; vocabulary.py:
a drafter's unembedding over some of the target's ids; folder.py: the head folder they share (save,
load, checked against its target).

This package knows nothing about drafting, decoding or the command line: it imports only lm/.
"""
