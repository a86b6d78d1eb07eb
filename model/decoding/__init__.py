"""Decoding: from a trained network to translations.

The searches over the networks of model/ (`beam_search`: AR greedy and beam search;
`refinement`: PaDIR's refinement and its variants; `draft_verify`: the drafter drafts,
the teacher verifies), the vocabulary `shortlist`, the `translator` that batches, encodes,
searches and times a decoding method, and the CTranslate2 glue (`ctranslate2_export`,
`ctranslate2_search`, `ctranslate2_worker`, `ctranslate2_sweep`). A room of its own inside
model/, as the JAX code it runs on: it reads the networks (`model.models`,
`model.transformer`) and restored artifacts (`model.trained_model`); the networks and their
training never import it (tests/test_imports.py), and a new decoding method touches this
folder and its entry in `components.config.DECODING_KINDS`.
"""
