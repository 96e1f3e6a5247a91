import numpy as np
import pytest

from ms_efficient.core.config import DataConfig
from ms_efficient.train.data import corpus_files, load_corpus


def test_split_is_deterministic_and_disjoint_by_file(text_dir):
    cfg = DataConfig(path=text_dir, val_fraction=0.2, max_bytes=10 ** 6)
    a, b = load_corpus(cfg, 16), load_corpus(cfg, 16)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.files == 40
    assert 0 < len(a.val) < len(a.train)


def test_batches_depend_only_on_seed_and_step(text_dir):
    corpus = load_corpus(DataConfig(path=text_dir, val_fraction=0.2), 16)
    x1, y1 = corpus.train_batch(5, 4, 16, seed=1)
    x2, y2 = corpus.train_batch(5, 4, 16, seed=1)
    x3, _ = corpus.train_batch(6, 4, 16, seed=1)
    assert x1.shape == (4, 16) and x1.dtype == np.int32
    assert np.array_equal(x1, x2) and not np.array_equal(x1, x3)
    # targets are the inputs shifted by one byte
    assert np.array_equal(x1[:, 1:], y1[:, :-1])


def test_single_file_is_split_by_position(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(bytes(range(256)) * 40)
    corpus = load_corpus(DataConfig(path=str(path), val_fraction=0.25), 8)
    assert len(corpus.train) == 7680 and len(corpus.val) == 2560


def test_max_bytes_caps_the_read(text_dir):
    corpus = load_corpus(DataConfig(path=text_dir, val_fraction=0.2, max_bytes=5000), 16)
    one_file = 40 * len("def function_0_0(x):\n    return x * 0 + 0\n")
    assert len(corpus.val) > 0
    assert len(corpus.train) + len(corpus.val) < 5000 + 2 * one_file


def test_too_little_text_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abc" * 100)
    with pytest.raises(ValueError, match="too little text"):
        load_corpus(DataConfig(path=str(path), val_fraction=0.1), 64)


def test_stdlib_corpus_has_python_sources():
    files = corpus_files(DataConfig())
    assert any(f.endswith("os.py") for f in files)
    assert not any("site-packages" in f for f in files)
