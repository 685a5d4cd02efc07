"""atk4 outside pass, surface 5 (and the CLI of surface 2): tif.write_report,
`tracinfunc report`, `tracinfunc score --contrast` (docs/attribution.md, docs/cli.md,
docs/rerank.md).

Failing tests (found by the pass) first; tests marked HELD guard attacks that held."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tracinfunc.errors import TracInFuncError

from . import _tiny as T

HOSTILE = [
    '<script>document.title="PWNED"</script>',
    '</textarea><script>document.title="PWNED2"</script>',
    "\"><img src=x onerror=\"document.title='PWNED3'\">",
    "'><svg onload=document.title='PWNED4'>",
    "abc\u202eevil\u2066x",
    "{title}{0}%s%(x)s",
    "A" * 20000,
    "<style>body{display:none}</style>",
    "<!--",
    "http://evil.example/x.png",
    "\x00\x1b[31mred",
    '<meta http-equiv="refresh" content="0;url=http://evil">',
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("atk4report")
    store = T.build(store=str(d / "g.zarr"))
    return d, store, T.query_grads()


def _rows(html):
    out = {}
    for qi, body in re.findall(r'<section class="query" data-query="(\d+)">(.*?)</section>', html, re.S):
        pro = re.search(r'<table class="pro">(.*?)</table>', body, re.S).group(1)
        opp = re.search(r'<table class="opp">(.*?)</table>', body, re.S).group(1)
        out[int(qi)] = (
            [int(x) for x in re.findall(r'data-row="(\d+)"', pro)],
            [int(x) for x in re.findall(r'data-row="(\d+)"', opp)],
        )
    return out


def _first_label(html):
    return re.search(r'<tr class="pro" data-row="\d+"><td>1</td><td>\d+</td><td class="score">[^<]*</td><td><bdi>([^<]*)', html).group(1)


# ----------------------------------------------------------------------------- failing


def test_report_refuses_k_above_n_train(setup):
    """write_report's docstring: k is 'at most n_train'; 'InvalidArgumentError: k or
    outliers out of range'. k=41 on 40 rows writes a page of 'top 40' instead."""
    d, store, q = setup
    with pytest.raises(TracInFuncError):
        tif.write_report(d / "k41.html", store, q, k=41, outliers=0)
    assert not (d / "k41.html").exists()


def test_report_refuses_outliers_above_n_train(setup):
    """As above for outliers=41 on 40 rows ('Self-influence outliers (top 40)')."""
    d, store, q = setup
    with pytest.raises(TracInFuncError):
        tif.write_report(d / "o41.html", store, q, k=3, outliers=41)


def test_report_of_a_contrast_says_it_is_a_contrast(setup):
    """rerank.md: a Contrast goes wherever test gradients go, and the contrast is recorded
    (repr, describe(), Reranked.contrast, the CLI's results). write_report accepts one and
    writes a page titled 'top 3 proponents and opponents by TracIn score (tif.top_k)' with
    no word of the contrast: a reader takes contrastive scores for plain TracIn."""
    d, store, q = setup
    ctrl = tif.build_store(T.LOSS, T.CKPTS, (T.X[:8], T.Y[:8]), projection=T.PROJ)
    query = tif.Contrast(q, ctrl, name="generic")
    p = tif.write_report(d / "contrast.html", store, query, k=3, outliers=0)
    html = Path(p).read_text(encoding="utf-8")
    _, i = tif.top_k(store, query, 3)
    assert _rows(html)[0][0] == list(np.asarray(i[0]))  # rows are right (held) ...
    assert "generic" in html and "contrast" in html.lower()  # ... but nothing says so


def test_report_refuses_token_scores_of_another_query(setup):
    """HOSTILE 3: tokens={1: scores} where scores were computed for query 0 is written
    under query 1 without a word. write_report holds query 1's test row, so the
    documents' summed token scores can be compared with query 1's scores of those rows
    (token_scores makes that check for rows=)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    d, _, _ = setup
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    loss = tif.causal_lm_loss(m)
    ck = [tif.Checkpoint.from_module(m, lr=0.1, name="a")]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (10, 8), generator=g)
    train = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    qids = torch.randint(0, 50, (2, 8), generator=g)
    query = {"input_ids": qids, "attention_mask": torch.ones_like(qids), "labels": qids.clone()}
    store = tif.build_store(loss, ck, train, projection=tif.Projection(dim=64, kind="kronecker"))
    test = tif.build_store(loss, ck, query, projection=store.projection)
    t0 = tif.build_store(loss, ck, {k: v[:1] for k, v in query.items()}, projection=store.projection)
    _, r = tif.top_k(store, t0, 4)
    rows = np.asarray(r[0])
    ts0 = tif.token_scores(store, t0, loss, ck, {k: v[rows] for k, v in train.items()}, rows=rows)
    with pytest.raises(TracInFuncError):
        tif.write_report(d / "tok-q1.html", store, test, k=4, train=train, tokens={1: ts0}, outliers=0)


def test_report_tensor_labels_show_numbers_not_reprs(setup):
    """HOSTILE 4: train_labels=torch.tensor([...]) is accepted and every label cell reads
    'tensor(0)' (NumPy labels read '0')."""
    d, store, q = setup
    p = tif.write_report(d / "tlabels.html", store, q, k=3, train_labels=T.Y, outliers=0)
    label = _first_label(Path(p).read_text(encoding="utf-8"))
    assert "tensor" not in label
    _, i = tif.top_k(store, q, 3)
    assert label == str(int(T.Y[int(i[0][0])]))


def test_report_mapping_labels_are_not_read_as_their_keys(setup):
    """HOSTILE 4: train_labels={row: 'a'} is accepted and each row is labelled with its
    key (the row number), not 'a'. Refuse a mapping, or use its values by row."""
    d, store, q = setup
    try:
        p = tif.write_report(d / "dlabels.html", store, q, k=3, outliers=0,
                             train_labels={i: "a" for i in range(40)})
    except TracInFuncError:
        return
    assert _first_label(Path(p).read_text(encoding="utf-8")) == "a"


def test_report_image_shape_mismatch_is_a_clear_error(setup):
    """image_shape=(2, 2) for 6-feature rows raises a raw RuntimeError ("shape '[2, 2]' is
    invalid for input of size 6"); on the CLI 'tracinfunc: error: RuntimeError: ...'.
    Expected an InvalidArgumentError naming image_shape and the item size."""
    d, store, q = setup
    with pytest.raises(TracInFuncError, match="image_shape"):
        tif.write_report(d / "img.html", store, q, k=3, train=torch.rand(40, 6), image_shape=(2, 2))


def test_report_lone_surrogate_label_is_shown_not_a_crash(setup):
    """attribution.md: every user string is escaped and control characters are shown as
    ⟨U+...⟩. A label holding a lone surrogate ('\\ud800', e.g. from a bad decode) raises a
    raw UnicodeEncodeError. Expected: shown as ⟨U+D800⟩ (or a TracInFuncError)."""
    d, store, q = setup
    try:
        p = tif.write_report(d / "surr.html", store, q, k=3, outliers=0, train_labels=["\ud800"] * 40)
    except TracInFuncError:
        return
    assert "U+D800" in Path(p).read_text(encoding="utf-8")


def test_report_label_length_error_names_the_argument(setup):
    """query_labels of the wrong length: the message says 'queries_labels has 4 items', an
    argument that does not exist."""
    d, store, q = setup
    with pytest.raises(TracInFuncError) as e:
        tif.write_report(d / "ql.html", store, q, k=3, query_labels=["a"] * 4)
    assert "query_labels" in str(e.value), str(e.value)


# --- CLI


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    d = tmp_path_factory.mktemp("atk4cli")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (d / "spec.py").write_text(textwrap.dedent(f"""
        import sys; sys.path.insert(0, {root!r})
        import tracinfunc as tif
        from tests.hostile import _tiny as T
        def make():
            return tif.cli.Spec(loss=T.LOSS, train=T.data(), checkpoints=T.CKPTS,
                                test={{"test": (T.XT, T.YT), "generic": (T.X[:8], T.Y[:8]),
                                       "empty": (T.X[:0], T.Y[:0])}})
    """))
    run = _runner(d)
    r = run("build", "--spec", f"{d}/spec.py:make", "--out", f"{d}/g.zarr", "--projection", "rademacher:8:0")
    assert r.returncode == 0, r.stderr
    return d, run


def _runner(d):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tracinfunc", "--quiet", *args], capture_output=True,
                              text=True, timeout=120, cwd=str(d))
    return run


def test_cli_contrast_weight_without_contrast_is_refused(cli):
    """cli.md: --contrast-weight W goes 'with --contrast'. Alone it is silently ignored and
    a plain score matrix is written (the user believes a contrast was subtracted).
    Expected a usage error and no output."""
    d, run = cli
    r = run("score", f"{d}/g.zarr", "--spec", f"{d}/spec.py:make", "--test", "test",
            "--contrast-weight", "2", "--output", f"{d}/w.json")
    assert r.returncode != 0
    assert not (d / "w.json").exists()


def test_cli_empty_contrast_set_is_named(cli):
    """rerank.md: an empty control set is refused *naming the control*. `--contrast empty`
    says 'data holds no examples' without naming the contrast set 'empty'."""
    d, run = cli
    r = run("score", f"{d}/g.zarr", "--spec", f"{d}/spec.py:make", "--test", "test",
            "--contrast", "empty", "--output", f"{d}/e.json")
    assert r.returncode == 1
    assert "empty" in r.stderr.replace("no examples", "") and ("contrast" in r.stderr or "control" in r.stderr), r.stderr


def test_cli_report_of_a_tabular_spec_writes_a_page(cli):
    """cli.md: `report` writes each test row with its proponents and opponents (thumbnails
    *with* --image-shape). On a spec of tabular rows without --image-shape it refuses:
    'queries items have shape (6,); pass image_shape=(H, W)' -- there is no way to get a
    rows-only page from the command line (the API's train=None gives one)."""
    d, run = cli
    r = run("report", f"{d}/g.zarr", "--spec", f"{d}/spec.py:make", "--test", "test",
            "--top-k", "3", "--output", f"{d}/tab.html")
    assert r.returncode == 0, r.stderr
    assert (d / "tab.html").exists()


def test_cli_report_bad_image_shape_is_one_clear_line(cli):
    d, run = cli
    r = run("report", f"{d}/g.zarr", "--spec", f"{d}/spec.py:make", "--test", "test",
            "--image-shape", "2x2", "--output", f"{d}/i22.html")
    assert r.returncode in (1, 2)
    assert "RuntimeError" not in r.stderr and "image" in r.stderr, r.stderr


# ----------------------------------------------------------------------------- HELD


def test_held_hostile_strings_are_inert_in_chromium_and_rows_equal_top_k(setup):
    """HELD: hostile labels/texts are escaped (no script, no element, no title change,
    bidi shown as ⟨U+202E⟩), the file loads nothing from outside, and after load the rows
    equal top_k's (proponents) and top_k(largest=False)'s (opponents)."""
    d, store, q = setup
    texts = [HOSTILE[i % len(HOSTILE)] for i in range(40)]
    labels = [HOSTILE[(i + 3) % len(HOSTILE)] for i in range(40)]
    p = tif.write_report(d / "hostile.html", store, q, k=5, train=texts, train_labels=labels,
                         queries=[HOSTILE[i] for i in range(5)],
                         query_labels=[HOSTILE[i + 5] for i in range(5)], outliers=5)
    html = Path(p).read_text(encoding="utf-8")
    assert "<script" not in html.lower() and "\u202e" not in html and "U+202E" in html
    assert not re.search(r'(?:src|href)\s*=\s*["\']?(?:https?:)?//', html)
    assert "@import" not in html and "@font-face" not in html
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium not installed")
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", f"file://{p}"],
                         capture_output=True, text=True, timeout=60).stdout
    assert re.findall(r"<title>(.*?)</title>", dom) == ["tracinfunc report"]
    assert "<script" not in dom and "<svg" not in dom and not re.search(r"<img[^>]*onerror", dom)
    got = _rows(dom)
    _, i = tif.top_k(store, q, 5)
    _, io = tif.top_k(store, q, 5, largest=False)
    for t in range(5):
        assert got[t] == (list(np.asarray(i[t])), list(np.asarray(io[t])))


def test_held_report_paths_never_land_on_artifacts(setup, tmp_path):
    """HELD: an existing file, a directory, a path inside a store/index/recording/curvature
    or through a symlink into a store are refused, and nothing there changes."""
    _d, store, q = setup
    p = tif.write_report(tmp_path / "a.html", store, q, k=3, outliers=0)
    before = Path(p).read_bytes()
    with pytest.raises(TracInFuncError):
        tif.write_report(p, store, q, k=3)
    assert Path(p).read_bytes() == before
    zs = tmp_path / "s.zarr"
    T.build(store=str(zs))
    before = T.files(zs)
    os.symlink(zs, tmp_path / "link")
    os.symlink(zs / "zarr.json", tmp_path / "link.html")
    for bad in (tmp_path, zs / "r.html", zs / "zarr.json", tmp_path / "link" / "r.html", tmp_path / "link.html"):
        with pytest.raises(TracInFuncError):
            tif.write_report(bad, store, q, k=3, overwrite=True)
    rec = tmp_path / "rec"
    T.train(str(rec))
    with pytest.raises(TracInFuncError):
        tif.write_report(rec / "r.html", store, q, k=3)
    assert T.files(zs) == before


def test_held_cli_contrast_scores_are_exact_and_recorded(cli):
    """HELD: `score --contrast generic --contrast-weight 0.5` equals the API's difference
    and the .json holds a 'contrast' key; an unknown name is one error line."""
    d, run = cli
    r = run("score", f"{d}/g.zarr", "--spec", f"{d}/spec.py:make", "--test", "test",
            "--contrast", "generic", "--contrast-weight", "0.5", "--output", f"{d}/c.json")
    assert r.returncode == 0, r.stderr
    out = json.loads((d / "c.json").read_text())
    assert out["contrast"]["control"] == "generic" and out["contrast"]["weight"] == 0.5
    st = tif.GradientStore.open(str(d / "g.zarr"))
    q = tif.build_store(T.LOSS, T.CKPTS, (T.XT, T.YT), projection=st.projection)
    c = tif.build_store(T.LOSS, T.CKPTS, (T.X[:8], T.Y[:8]), projection=st.projection)
    want = np.asarray(tif.score(st, q)) - 0.5 * np.asarray(tif.score(st, c)).mean(0)
    np.testing.assert_allclose(np.array(out["scores"]), want, atol=1e-6)
    r = run("score", f"{d}/g.zarr", "--spec", f"{d}/spec.py:make", "--test", "test",
            "--contrast", "nope", "--output", f"{d}/n.json")
    assert r.returncode == 1 and "nope" in r.stderr and not (d / "n.json").exists()
