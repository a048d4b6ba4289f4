"""xformers_jax.data: generators correct and seeded, loaders on fixtures, iterators resumable."""

import json
import os
import pickle

import numpy as np
import pytest

from xformers_jax import data

# ---------------------------------------------------------------- ListOps


def _reference_value(tokens):
    """An independent recursive evaluator (not the library's stack machine)."""
    def parse(i):
        token = tokens[i]
        if token.isdigit():
            return int(token), i + 1, 0
        args, depth, i = [], 0, i + 1
        while tokens[i] != "]":
            value, i, d = parse(i)
            args.append(value)
            depth = max(depth, d)
        ops = {"[MIN": min, "[MAX": max, "[SM": lambda a: sum(a) % 10,
               "[MED": lambda a: int(np.median(a))}
        return ops[token](args), i + 1, depth + 1
    value, end, depth = parse(0)
    assert end == len(tokens)
    return value, depth



@pytest.mark.parametrize("seed", [0, 1])
def test_listops_labels_lengths_and_limits(seed):
    source = data.ListOps(40, seed=seed, min_length=20, max_length=60, max_depth=4, max_args=5)
    for i in range(len(source)):
        tokens = source.expression(i)
        value, depth = _reference_value(tokens)
        example = source[i]
        assert int(example["targets"]) == value
        assert 20 <= len(tokens) <= 60
        assert depth <= 4
        ids = example["inputs"]
        assert ids.shape == (60,) and ids.dtype == np.int32
        assert np.all(ids[: len(tokens)] > 0) and np.all(ids[len(tokens):] == 0)
        assert [data.LISTOPS_VOCAB[j] for j in ids[: len(tokens)]] == tokens


def test_listops_argument_counts_and_label_spread():
    source = data.ListOps(60, seed=3, min_length=10, max_length=80, max_depth=5, max_args=4)
    labels = []
    for i in range(len(source)):
        tokens = source.expression(i)
        stack = []
        for t in tokens:
            if stack and t != "]":
                stack[-1] += 1
            if t.startswith("["):
                stack.append(0)
            elif t == "]":
                assert 2 <= stack.pop() <= 4
        labels.append(int(source[i]["targets"]))
    assert len(set(labels)) >= 5


def test_listops_full_size_lengths():
    source = data.ListOps(3, seed=0)
    for i in range(3):
        assert 500 <= len(source.expression(i)) <= 2000
        assert source[i]["inputs"].shape == (2000,)


def test_listops_deterministic_per_seed():
    a = data.ListOps(5, seed=7, min_length=10, max_length=50, max_depth=4, max_args=4)
    b = data.ListOps(5, seed=7, min_length=10, max_length=50, max_depth=4, max_args=4)
    c = data.ListOps(5, seed=8, min_length=10, max_length=50, max_depth=4, max_args=4)
    assert all(a.expression(i) == b.expression(i) for i in range(5))
    assert any(a.expression(i) != c.expression(i) for i in range(5))


def test_listops_tokenize_lra_text_and_errors():
    text = "( ( ( [MAX 2 ) 9 ) ( ( [MIN 4 7 ) ] ) ) ]"
    tokens = data.tokenize_listops(text)
    assert tokens == ["[MAX", "2", "9", "[MIN", "4", "7", "]", "]"]
    assert data.evaluate_listops(tokens) == _reference_value(tokens)[0] == 9
    with pytest.raises(ValueError, match="more than length=3"):
        data.encode_listops(tokens, 3)
    with pytest.raises(ValueError, match="unknown ListOps symbol"):
        data.encode_listops(["[FIRST", "1", "]"], 5)
    with pytest.raises(ValueError, match="min_length"):
        data.random_listops_expression(np.random.default_rng(0), min_length=10, max_length=5)


def test_listops_median_truncates_like_lra():
    assert data.evaluate_listops(["[MED", "1", "4", "]"]) == 2
    assert data.evaluate_listops(["[SM", "9", "8", "]"]) == 7


# ---------------------------------------------------------------- Pathfinder


def _components(ink, link=2):
    """Connected components of ink pixels, linking pixels at Chebyshev distance <= link."""
    labels = np.full(ink.shape, -1)
    n = 0
    for start in zip(*np.nonzero(ink)):
        if labels[start] >= 0:
            continue
        labels[start], stack = n, [start]
        while stack:
            r, c = stack.pop()
            for dr in range(-link, link + 1):
                for dc in range(-link, link + 1):
                    rr, cc = r + dr, c + dc
                    if (0 <= rr < ink.shape[0] and 0 <= cc < ink.shape[1] and ink[rr, cc]
                            and labels[rr, cc] < 0):
                        labels[rr, cc] = n
                        stack.append((rr, cc))
        n += 1
    return labels, n


@pytest.mark.parametrize("size,difficulty", [(32, "easy"), (32, "hard"), (48, "intermediate")])
def test_pathfinder_labels_true_to_the_drawing(size, difficulty):
    source = data.Pathfinder(12, seed=0, size=size, difficulty=difficulty)
    labels = []
    for i in range(len(source)):
        image, label, markers = source.draw(i)
        assert image.shape == (size, size) and image.dtype == np.uint8
        components, n = _components(image > 0)
        assert n >= 2  # both main contours are always drawn; distractors when they fit
        ends = [components[tuple(m)] for m in markers]
        assert min(ends) >= 0  # markers are drawn
        assert (ends[0] == ends[1]) == bool(label)
        np.testing.assert_array_equal(source[i]["inputs"], image.reshape(-1))
        labels.append(label)
    assert 0 < sum(labels) < len(labels)


def test_pathfinder_forced_labels_and_path_x_size():
    rng = np.random.default_rng(1)
    for label in (0, 1):
        image, got, markers = data.draw_pathfinder(rng, size=32, label=label)
        components, _ = _components(image > 0)
        assert got == label
        assert (components[tuple(markers[0])] == components[tuple(markers[1])]) == bool(label)
    image, label, markers = data.draw_pathfinder(np.random.default_rng(2), size=data.PATHX_SIZE,
                                                 difficulty="hard", num_distractors=4)
    assert image.shape == (128, 128)
    components, _ = _components(image > 0)
    assert (components[tuple(markers[0])] == components[tuple(markers[1])]) == bool(label)


def test_pathfinder_deterministic_and_errors():
    a = data.Pathfinder(3, seed=5, size=32, difficulty="easy")
    b = data.Pathfinder(3, seed=5, size=32, difficulty="easy")
    c = data.Pathfinder(3, seed=6, size=32, difficulty="easy")
    assert all(np.array_equal(a[i]["inputs"], b[i]["inputs"]) for i in range(3))
    assert not all(np.array_equal(a[i]["inputs"], c[i]["inputs"]) for i in range(3))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="size must be in 32..128"):
        data.draw_pathfinder(rng, size=16)
    with pytest.raises(ValueError, match="difficulty"):
        data.draw_pathfinder(rng, difficulty="medium")


# ---------------------------------------------------------------- byte-level tasks


def test_stdlib_splits_disjoint_and_covering():
    files = data._bytes.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    splits = {s: {f for f in files if data._bytes.split_of(f) == s}
              for s in ("train", "validation", "test")}
    assert all(splits.values())
    assert not (splits["train"] & splits["validation"] or splits["train"] & splits["test"]
                or splits["validation"] & splits["test"])
    assert set().union(*splits.values()) == set(files)


def test_stdlib_bytes_lm_windows():
    lm = data.stdlib_bytes_lm("test", seq_len=128)
    assert len(lm) > 10
    a, b = lm[0], lm[1]
    np.testing.assert_array_equal(a["inputs"][1:], a["targets"][:-1])
    assert a["targets"][-1] == b["inputs"][0]
    assert 1 <= a["inputs"].min() and a["inputs"].max() < data.BYTE_VOCAB_SIZE


def _fake_stdlib(root, n=120):
    for i in range(n):
        d = root / ("test" if i % 2 else "pkg")
        d.mkdir(exist_ok=True)
        body = ("def test_%d(self):\n    self.assertEqual(1, 1)\n" if i % 2 else
                "def helper_%d(x):\n    return x\n") % i
        (d / f"mod{i}.py").write_text(body * 3)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "ignored.py").write_text("x = 1\n")


def test_byte_classification_labels_follow_files(tmp_path):
    _fake_stdlib(tmp_path)
    source = data.StdlibBytesClassification("train", seq_len=64, num_examples=30, seed=0,
                                            root=str(tmp_path))
    assert not any("site-packages" in f for c in source.classes for f in c)
    for i in range(30):
        example = source[i]
        text = bytes((example["inputs"][example["inputs"] > 0] - 1).astype(np.uint8).tolist())
        assert (b"assert" in text or b"test_" in text) == bool(example["targets"])
    again = data.StdlibBytesClassification("train", seq_len=64, num_examples=30, seed=0,
                                           root=str(tmp_path))
    assert all(np.array_equal(source[i]["inputs"], again[i]["inputs"]) for i in range(30))
    other = data.StdlibBytesClassification("validation", seq_len=64, num_examples=3, seed=0,
                                           root=str(tmp_path))
    assert not set(sum(source.classes, [])) & set(sum(other.classes, []))


# ---------------------------------------------------------------- loaders on fixtures


def test_load_imdb(tmp_path):
    for split in ("train", "test"):
        for name, text in (("neg", "awful film"), ("pos", "a great film, loved it")):
            d = tmp_path / "aclImdb" / split / name
            d.mkdir(parents=True)
            (d / "0_1.txt").write_text(text)
            (d / "1_2.txt").write_text(text + "!")
    source = data.load_imdb(str(tmp_path), "train", seq_len=16)
    assert len(source) == 4
    np.testing.assert_array_equal(source.arrays["targets"], [0, 0, 1, 1])
    first = source[0]["inputs"]
    np.testing.assert_array_equal(first[:10], np.frombuffer(b"awful film", np.uint8) + 1)
    assert np.all(first[10:] == 0)
    assert source[2]["inputs"].shape == (16,)  # truncated
    with pytest.raises(FileNotFoundError, match=r"aclImdb/test/neg"):
        data.load_imdb(str(tmp_path / "nowhere"), "test", seq_len=16)


def test_load_aan(tmp_path):
    rows = ["label\tid1\tid2\ttext1\ttext2", "1.0\ta\tb\tfirst paper\tsecond paper",
            "0.0\tc\td\tthird\tfourth one"]
    (tmp_path / "new_aan_pairs.eval.tsv").write_text("\n".join(rows) + "\n")
    source = data.load_aan(str(tmp_path), "validation", seq_len=8)
    np.testing.assert_array_equal(source.arrays["targets"], [1, 0])
    np.testing.assert_array_equal(source[1]["inputs1"][:5], np.frombuffer(b"third", np.uint8) + 1)
    assert source[0]["inputs2"].shape == (8,)
    with pytest.raises(FileNotFoundError, match="new_aan_pairs.train.tsv"):
        data.load_aan(str(tmp_path), "train", seq_len=8)


def test_load_cifar10(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[name] = {b"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8),
                         b"labels": list(rng.integers(0, 10, 10))}
        with open(d / name, "wb") as fh:
            pickle.dump(batches[name], fh)
    train = data.load_cifar10(str(tmp_path), "train", grayscale=False)
    val = data.load_cifar10(str(tmp_path), "validation", grayscale=False)
    assert len(train) == 45 and len(val) == 5
    raw = batches["data_batch_1"][b"data"][0]
    np.testing.assert_array_equal(train[0]["inputs"][2, 3], raw[[2 * 32 + 3, 1024 + 2 * 32 + 3,
                                                                   2048 + 2 * 32 + 3]])
    gray = data.load_cifar10(str(tmp_path), "test")
    assert gray[0]["inputs"].shape == (1024,)
    r, g, b = (batches["test_batch"][b"data"][0][c * 1024].astype(float) for c in range(3))
    assert gray[0]["inputs"][0] == int(0.2989 * r + 0.587 * g + 0.114 * b)
    os.remove(d / "data_batch_3")
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        data.load_cifar10(str(tmp_path), "train")


def test_load_enwik8_and_listops_tsv(tmp_path):
    payload = bytes(range(256)) * 4
    (tmp_path / "enwik8").write_bytes(payload)
    train = data.load_enwik8(str(tmp_path), "train", seq_len=16)
    test = data.load_enwik8(str(tmp_path), "test", seq_len=16)
    assert len(train) == (len(payload) * 9 // 10 - 1) // 16
    np.testing.assert_array_equal(test[0]["inputs"],
                                  np.frombuffer(payload[len(payload) * 19 // 20:][:16],
                                                np.uint8) + 1)
    with pytest.raises(FileNotFoundError, match="enwik8"):
        data.load_enwik8(str(tmp_path / "x"), "train", seq_len=16)
    (tmp_path / "basic_val.tsv").write_text("Source\tTarget\n( ( [SM 3 ) 9 ) ]\t2\n")
    listops = data.load_listops_tsv(str(tmp_path), "validation", max_length=8)
    assert int(listops[0]["targets"]) == 2
    assert [data.LISTOPS_VOCAB[i] for i in listops[0]["inputs"][:4]] == ["[SM", "3", "9", "]"]


# ---------------------------------------------------------------- iterators


def _ids(n):
    return data.ArraySource({"inputs": np.arange(n)[:, None] * np.ones((1, 3), np.int32),
                             "targets": np.arange(n)})


def test_iterator_deterministic_and_reshuffles_per_epoch():
    a = data.DataIterator(_ids(20), batch_size=4, seed=1)
    b = data.DataIterator(_ids(20), batch_size=4, seed=1)
    first = [next(a)["targets"] for _ in range(10)]
    assert all(np.array_equal(x, next(b)["targets"]) for x in first)
    epoch0, epoch1 = np.concatenate(first[:5]), np.concatenate(first[5:])
    assert sorted(epoch0) == list(range(20)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1)
    other = data.DataIterator(_ids(20), batch_size=4, seed=2)  # seeds 1, 2: unrelated orders
    others = np.concatenate([next(other)["targets"] for _ in range(10)])
    assert not np.array_equal(others[:20], epoch0) and not np.array_equal(others[:20], epoch1)


def test_iterator_shards_disjoint_and_covering():
    source = _ids(23)
    seen = []
    for p in range(3):
        it = data.DataIterator(source, batch_size=7, seed=4, process_index=p, process_count=3,
                               num_epochs=2)
        seen.append([next(it)["targets"] for _ in range(2)])  # one batch per epoch
        with pytest.raises(StopIteration):
            next(it)
    for epoch in (0, 1):
        shares = [s[epoch] for s in seen]
        assert all(len(s) == 7 for s in shares)
        union = np.concatenate(shares)
        assert len(set(union.tolist())) == 21  # disjoint; 23 // 3 * 3 covered
    # Each process reads its contiguous rows of the one-process global batch: the global
    # batches (and a checkpointed position in them) do not depend on the process count.
    whole = data.batches(source, batch_size=21, seed=4, num_epochs=2)
    for epoch in (0, 1):
        np.testing.assert_array_equal(np.concatenate([s[epoch] for s in seen]),
                                      whole[epoch]["targets"])
    states = set()
    for count in (1, 3):
        it = data.DataIterator(source, batch_size=21 // count, seed=4, process_index=0,
                               process_count=count)
        next(it)
        states.add(json.dumps(it.get_state(), sort_keys=True))
    assert len(states) == 1, states


def test_iterator_state_round_trip_across_epochs():
    it = data.DataIterator(_ids(10), batch_size=3, seed=2)
    for _ in range(4):  # into the second epoch (3 batches per epoch)
        next(it)
    state = it.get_state()
    assert json.loads(json.dumps(state)) == state  # what the checkpoint stores
    expected = [next(it)["targets"] for _ in range(5)]
    resumed = data.DataIterator(_ids(10), batch_size=3, seed=2)
    resumed.set_state(dict(state))
    assert all(np.array_equal(x, next(resumed)["targets"]) for x in expected)
    with pytest.raises(ValueError, match="before the Grain pipeline"):
        resumed.set_state({"epoch": 1, "position": 3, "seed": 2})


def test_every_task_source_is_a_grain_data_source():
    import grain

    sources = [_ids(3), data.ListOps(2, seed=0, min_length=5, max_length=20, max_depth=3,
                                     max_args=3),
               data.Pathfinder(2, seed=0, size=32, difficulty="easy"),
               data.stdlib_bytes_lm("validation", seq_len=16),
               data.StdlibBytesClassification("validation", seq_len=16, num_examples=2, seed=0)]
    for source in sources:
        assert isinstance(source, grain.sources.RandomAccessDataSource), type(source)
        batch = data.batches(source, batch_size=2, seed=0)[0]  # a Grain MapDataset
        assert all(len(v) == 2 for v in batch.values())


@pytest.mark.slow
def test_iterator_worker_processes_give_the_same_batches_and_resume():
    # Grain worker processes (off by default and in the other tests: they cost seconds).
    plain = data.DataIterator(_ids(40), batch_size=4, seed=3)
    expected = [next(plain)["targets"] for _ in range(17)]
    plain.close()
    workers = data.DataIterator(_ids(40), batch_size=4, seed=3, worker_count=2)
    try:
        assert all(np.array_equal(x, next(workers)["targets"]) for x in expected[:12])
        state = json.loads(json.dumps(workers.get_state()))
        assert all(np.array_equal(x, next(workers)["targets"]) for x in expected[12:])
        workers.set_state(state)
        assert all(np.array_equal(x, next(workers)["targets"]) for x in expected[12:])
    finally:
        workers.close()


def test_iterator_epochs_remainder_and_errors():
    it = data.DataIterator(_ids(5), batch_size=2, shuffle=False, num_epochs=2,
                           drop_remainder=False)
    sizes = [len(b["targets"]) for b in it]
    assert sizes == [2, 2, 1, 2, 2, 1]
    with pytest.raises(ValueError, match="batch_size=8"):
        data.DataIterator(_ids(5), batch_size=8)
    with pytest.raises(ValueError, match="process_index"):
        data.DataIterator(_ids(5), batch_size=1, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="leading axis"):
        data.ArraySource({"a": np.zeros(3), "b": np.zeros(4)})
    materialized = data.materialize(data.ListOps(4, seed=0, min_length=5, max_length=20,
                                                 max_depth=3, max_args=3))
    assert materialized.arrays["inputs"].shape == (4, 20)
