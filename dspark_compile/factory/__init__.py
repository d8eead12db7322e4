"""The checkpoint factory: the checkpoints this project makes for itself, apart from the
reference model that reads them (models/, imported as dspark_compile.models).

    presets.py         the synthetic model shapes (tiny, tiny-deep, flash-slice, ...)
    synth.py           the checkpoint of a preset (`synth`): random, or the trained pair
    random_weights.py  a synthetic checkpoint's tensors (random, well-conditioned, quantised)
    checkpoint_dir.py  a checkpoint directory's files, written atomically
    tokenizer.py       the tiny byte-level BPE tokenizer
    committed.py       the trained tiny pair committed in data/tiny-trained
    train.py, train_data.py, train_model.py   how that pair is trained

Imports run one way: synth.py -> train.py -> random_weights.py, checkpoint_dir.py, committed.py.
"""
