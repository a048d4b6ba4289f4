"""xformers_jax_experiments.catalogue: one table row per registered kind of every slot of the
registry."""

import re

from xformers_jax import nn
from xformers_jax_experiments import catalogue as C


def _rows(text):
    return re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.MULTILINE)


def test_every_registered_kind_of_every_slot_has_one_row():
    text = C.catalogue()
    expected = []
    for title, _, slot, _ in C._SLOTS:
        kinds = C.slot_kinds(slot)
        assert f"## {title}" in text
        names = nn.registered_kinds(slot)
        # Every registered kind declares its metadata (a kind without it is not listed).
        assert [k.name for k in kinds] == [n for n in names
                                           if nn.get_kind(slot, n).missing() == ()]
        expected += [k.name for k in kinds]
    assert sorted(_rows(text)) == sorted(expected)
    assert "dot_product" in _rows(text)


def test_a_registry_nn_does_not_have_is_skipped(monkeypatch):
    monkeypatch.setattr(C, "_SLOTS", C._SLOTS[:1] + (
        ("Imaginary layers", "`nn.NoSpec`", "imaginary", ()),))
    text = C.catalogue()
    assert "Imaginary layers" not in text and "## Attention kinds" in text


def _row_of(text, kind):
    (row,) = [line for line in text.splitlines() if line.startswith(f"| `{kind}` |")]
    return row


def test_hyperparameters_show_defaults_meanings_and_required_ones():
    text = C.catalogue()
    nystrom = _row_of(text, "nystrom")
    # A required hyperparameter is visible as required, with its meaning, before the others.
    assert "`num_landmarks` (**required**): landmarks m" in nystrom
    assert nystrom.index("num_landmarks") < nystrom.index("`kernel_size=33`: width")
    flash = _row_of(text, "flash")
    assert "`pattern=None`: a static sparsity pattern" in flash


def test_every_row_links_its_paper():
    text = C.catalogue()
    for kind in _rows(text):
        assert "](https://arxiv.org/" in _row_of(text, kind), kind
    assert "](https://arxiv.org/abs/2009.14794)" in _row_of(text, "performer")


def test_measured_columns_come_from_the_training_step_suites():
    import json
    import os

    with open(os.path.join(C._RESULTS, "lra.json")) as f:
        records = json.load(f)["records"]
    step = {r["params"]["kind"]: r for r in records if r["params"].get("L") == 4096}
    ratio = step["performer"]["time_s"] / step["dot_product"]["time_s"]
    memory = step["performer"]["compiled_mb"] / step["dot_product"]["compiled_mb"]
    row = _row_of(C.catalogue(), "performer")
    time_col = C._COLUMNS.index("step time")
    assert f"CPU {ratio:.2f}x" in row.split(" | ")[time_col]
    assert f"CPU {memory:.2f}x" in row.split(" | ")[time_col + 1]
    assert _row_of(C.catalogue(), "nystrom").split(" | ")[time_col] == "—"  # not in the suite


def test_main_says_what_it_wrote(tmp_path, capsys):
    from absl import flags

    out = tmp_path / "CATALOGUE.md"
    # Set this flag alone: parsing argv would also run the validators of flags other modules
    # imported by this test process define (the trainer CLI's required --config).
    flags.FLAGS.mark_as_parsed()
    flags.FLAGS.catalogue_out = str(out)
    try:
        C.main([])
    finally:
        flags.FLAGS.unparse_flags()
    assert out.read_text() == C.catalogue()
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "attention kinds" in printed


def test_recall_column_reads_the_zoo_results(tmp_path, monkeypatch):
    """The largest finished MQAR setting per kind, the best over learning rates; blank for a
    kind without one (an unfinished run, another task, or no run)."""
    import json

    def row(kind, L, d, lr, acc, task="mqar", slot="attention"):
        return dict(task=task, slot=slot, kind=kind, L=L, d=d, lr=lr, test_accuracy=acc)

    rows = [row("dot_product", 64, 64, 1e-3, 0.9), row("dot_product", 256, 64, 1e-3, 0.7),
            row("dot_product", 256, 128, 1e-3, 0.25), row("dot_product", 256, 128, 3e-3, 0.75),
            row("dot_product", 512, 128, 1e-3, None),  # not finished
            row("performer", 64, 64, 1e-3, 0.125, task="selective_copy"),
            row("mamba", 128, 64, 1e-3, 0.5, slot="mixer")]
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps(dict(grid="cpu", rows=rows)))
    monkeypatch.setattr(C, "_ZOO", str(path))
    assert C.recall() == {("attention", "dot_product"): (0.75, 256, 128),
                          ("mixer", "mamba"): (0.5, 128, 64)}
    text = C.catalogue()
    col = C._COLUMNS.index("recall")
    assert _row_of(text, "dot_product").split(" | ")[col] == "0.75 (L=256, d=128)"
    assert _row_of(text, "mamba").split(" | ")[col] == "0.50 (L=128, d=64)"
    assert _row_of(text, "performer").split(" | ")[col] == ""
    monkeypatch.setattr(C, "_ZOO", str(tmp_path / "missing.json"))
    assert _row_of(C.catalogue(), "dot_product").split(" | ")[col] == ""
