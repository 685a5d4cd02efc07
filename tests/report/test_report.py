"""The HTML report: rendered in a real headless browser, checked after load."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import tracinfunc as tif
from tracinfunc.errors import InvalidArgumentError, NonFiniteGradientError, OutputPathError
from tracinfunc.report.html import number, token_span
from tracinfunc.report.png import png_bytes

HOSTILE = ['<img src=x onerror="document.title=\'pwned\'">', "</textarea><script>"
           "document.title='pwned'</script>", "\"'><b>quote</b>", "abc\u202eevil\u2066x",
           "</style><i>", "{title}"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="needs a headless browser: apt-get install chromium")


def digits_setup(n_train=60, n_test=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n_train + n_test, 64, generator=g)
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).eval()
    loss = tif.loss_from_module(model, nn.functional.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1)]
    spec = tif.Projection(dim=32, seed=0)
    store = tif.build_store(loss, ckpts, (x[:n_train], y[:n_train]), projection=spec,
                            progress=False)
    test = tif.build_store(loss, ckpts, (x[n_train:], y[n_train:]), projection=spec,
                           progress=False)
    return store, test, x, y


class Dom(HTMLParser):
    """Rows by class, in document order, plus the title and every <img>/<script>."""

    def __init__(self):
        super().__init__()
        self.rows, self.title, self.tags, self._in_title = [], "", [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "tr" and "data-row" in attrs:
            self.rows.append((attrs.get("class"), int(attrs["data-row"])))
        self._in_title = tag == "title"

    def handle_endtag(self, tag):
        self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def render(path, tmp_path):
    """``(DOM after load, screenshot PNG bytes)`` from headless chromium."""
    args = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*args, "--dump-dom", path.resolve().as_uri()], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    shot = tmp_path / "shot.png"
    subprocess.run([*args, f"--screenshot={shot}", "--window-size=1000,800",
                    path.resolve().as_uri()], capture_output=True, timeout=120, check=True)
    return dom, shot.read_bytes()


def png_pixels(data: bytes):
    """Decoded 8-bit RGB(A) pixels of a non-interlaced PNG, as a flat list of bytes."""
    pos, chunks, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks += body
        pos += 12 + length
    width, height, _, colour, *_ = header
    channels = {2: 3, 6: 4, 0: 1}[colour]
    raw, stride, out, prev = zlib.decompress(chunks), width * channels, [], [0] * width * channels
    for y in range(height):
        kind, line = raw[y * (stride + 1)], list(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            p = a + b - c
            pred = a if abs(p - a) <= min(abs(p - b), abs(p - c)) else (
                b if abs(p - b) <= abs(p - c) else c)
            line[i] = (line[i] + [0, a, b, (a + b) // 2, pred][kind]) & 255
        out += line
        prev = line
    return out


@needs_browser
def test_the_page_renders_the_top_k_rows_and_no_hostile_label_runs(tmp_path):
    store, test, x, y = digits_setup()
    labels = [HOSTILE[i % len(HOSTILE)] + str(int(y[i])) for i in range(60)]
    path = tif.write_report(tmp_path / "report.html", store, test, k=10, train=x[:60],
                            train_labels=labels, queries=x[60:], query_labels=HOSTILE[:4],
                            image_shape=(8, 8), outliers=5)
    dom, shot = render(path, tmp_path)
    parsed = Dom()
    parsed.feed(dom)
    assert parsed.title == "tracinfunc report"
    _, pro = tif.top_k(store, test, k=10)
    _, opp = tif.top_k(store, test, k=10, largest=False)
    got_pro = [row for kind, row in parsed.rows if kind == "pro"]
    got_opp = [row for kind, row in parsed.rows if kind == "opp"]
    assert got_pro == pro.flatten().tolist() and got_opp == opp.flatten().tolist()
    assert sum(kind == "outlier" for kind, _ in parsed.rows) == 5
    assert not any(tag in ("script", "textarea", "b") for tag, _ in parsed.tags)
    assert not any(tag == "img" and attrs.get("src") == "x" for tag, attrs in parsed.tags)
    assert "document.title='pwned'" in dom.replace("&#x27;", "'").replace("&#39;", "'")
    assert "\u202e" not in dom and "\u27e8U+202E\u27e9" in dom
    pixels = png_pixels(shot)
    assert shot.startswith(b"\x89PNG") and len(set(pixels)) > 10  # not blank


@needs_browser
def test_thumbnails_are_drawn(tmp_path):
    store, test, _, _ = digits_setup()
    black = torch.zeros(60, 8, 8)  # a constant image is drawn black; the page's text is #222
    path = tif.write_report(tmp_path / "b.html", store, test, k=10, train=black, outliers=0)
    _, shot = render(path, tmp_path)
    pixels = png_pixels(shot)
    channels = 4 if len(pixels) == 1000 * 800 * 4 else 3
    black_pixels = sum(pixels[i:i + 3] == [0, 0, 0] for i in range(0, len(pixels), channels))
    assert black_pixels > 10 * 30 * 30  # at least the first query's ten 32 x 32 thumbnails


@needs_browser
def test_token_highlighting_renders_one_span_per_token(tmp_path):
    from tests.lm_helpers import tiny_gpt2, token_batch

    model = tiny_gpt2()
    ckpts, loss, docs = [tif.Checkpoint.from_module(model)], tif.causal_lm_loss(model), \
        token_batch(5, 8)
    spec = tif.Projection(dim=32, kind="kronecker")
    store = tif.build_store(loss, ckpts, docs, projection=spec, progress=False)
    test = tif.build_store(loss, ckpts, token_batch(1, 8, seed=2), projection=spec,
                           progress=False)
    _, rows = tif.top_k(store, test, k=3)
    chosen = {key: value[rows[0]] for key, value in docs.items()}
    scores = tif.token_scores(store, test, loss, ckpts, chosen, rows=rows[0])
    path = tif.write_report(tmp_path / "t.html", store, test, k=3, train=docs,
                            tokens={0: scores}, decode=lambda t: HOSTILE[t % 6])
    dom, _ = render(path, tmp_path)
    parsed = Dom()
    parsed.feed(dom)
    spans = [attrs for tag, attrs in parsed.tags if tag == "span" and attrs.get("class") == "tok"]
    assert len(spans) == int(scores.scored.sum())
    assert parsed.title == "tracinfunc report"


def test_hostile_strings_are_escaped_in_the_file(tmp_path):
    store, test, _, _ = digits_setup()
    path = tif.write_report(tmp_path / "r.html", store, test, k=3, train=HOSTILE * 10,
                            query_labels=HOSTILE[:4])
    page = path.read_text()
    for hostile in HOSTILE[:3]:
        assert hostile not in page
    assert "<script" not in page and "http://" not in page and "https://" not in page


def test_nan_scores_k_beyond_the_rows_and_paths(tmp_path):
    store, test, x, _ = digits_setup(n_train=6)
    rows = torch.stack([test.read_rows(0, 0, 4)])
    with pytest.raises(InvalidArgumentError, match=r"k must be an int in \[1, 6\]"):
        tif.write_report(tmp_path / "n.html", store, rows, k=50)  # k > n_train: refused
    assert not (tmp_path / "n.html").exists()
    path = tif.write_report(tmp_path / "n.html", store, rows, k=6)  # k = n_train: all rows
    page = path.read_text()
    assert page.count('class="pro"') == 4 * 6 + 4  # 6 rows per query (+ each table's class)
    bad = rows.clone()
    bad[0, 1, 0] = float("nan")  # NaN test rows: refused by top_k, before the file is made
    with pytest.raises(NonFiniteGradientError, match="NaN"):
        tif.write_report(tmp_path / "nan.html", store, bad)
    assert not (tmp_path / "nan.html").exists()
    with pytest.raises(OutputPathError, match="exists"):
        tif.write_report(path, store, rows)
    with pytest.raises(OutputPathError, match=".html"):
        tif.write_report(tmp_path / "n.json", store, rows)
    with pytest.raises(OutputPathError, match="inside"):
        tif.save_store(store, tmp_path / "s.zarr")
        tif.write_report(tmp_path / "s.zarr" / "r.html", store, rows)
    with pytest.raises(InvalidArgumentError, match="k must be"):
        tif.write_report(tmp_path / "k.html", store, rows, k=0)
    with pytest.raises(InvalidArgumentError, match="train has 5 items"):
        tif.write_report(tmp_path / "k.html", store, rows, train=x[:5], image_shape=(8, 8))
    fake = tif.TokenScores(torch.zeros(1, 1, 3), torch.ones(1, 3, dtype=torch.bool),
                           torch.zeros(1, 3, dtype=torch.long), torch.tensor([99]))
    with pytest.raises(InvalidArgumentError, match="explains row 99"):
        tif.write_report(tmp_path / "k.html", store, rows, tokens={0: fake})
    with pytest.raises(InvalidArgumentError, match="one query"):
        tif.write_report(tmp_path / "k.html", store, rows, tokens={7: fake})
    assert not (tmp_path / "k.html").exists()


def test_png_thumbnails_decode_to_the_image():
    image = torch.arange(64.0).reshape(8, 8)
    pixels = png_pixels(png_bytes(image))
    assert pixels[0] == 0 and pixels[-1] == 255 and len(pixels) == 64


def test_non_finite_token_scores_show_as_text_in_grey():
    assert [number(v) for v in (float("nan"), float("inf"), -float("inf"), 0.5)] == [
        "nan", "+inf", "-inf", "+0.5"]
    assert "rgba(128,128,128" in token_span("a", float("nan"), 1.0)
    assert 'title="nan"' in token_span("a", float("nan"), 1.0)
