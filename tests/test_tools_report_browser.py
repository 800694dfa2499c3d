"""The HTML report of `compare` as a real browser draws it: headless Chromium takes a screenshot,
and the test reads its pixels. Skipped where no Chromium is installed (Debian: `apt-get install
chromium`); a screenshot takes a few seconds.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from atb_probe.tools.compare import compare_dumps, write_outputs

from conftest import dump, generate, tiny_llama
from harness import config

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium installed")

WIDTH, HEIGHT = 1400, 1000
DIVERGENCE_BOX = (253, 232, 232)   # div.bad background
CROSSING_POINT = (204, 34, 34)     # .pb: an output that crosses the thresholds
SCAN_BOX = (243, 236, 251)         # div.scan background
SCAN_MARK = (138, 43, 226)         # .nf: the square on the first NaN/Inf


def screenshot(html: str, tmp_path) -> np.ndarray:
    """The first screen of a report as an (HEIGHT, WIDTH, 3) array of RGB bytes."""
    png = tmp_path / "shot.png"
    run = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
         f"--window-size={WIDTH},{HEIGHT}", f"file://{html}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert png.is_file(), run.stderr[-2000:]
    with Image.open(png) as image:
        return np.asarray(image.convert("RGB"))


def pixels(image: np.ndarray, rgb: tuple) -> np.ndarray:
    """(y, x) of the pixels of exactly this colour."""
    return np.argwhere(np.all(image == np.array(rgb, np.uint8), axis=2))


def llama_dump(tmp_path_factory, name, scale=1.0, dtype=torch.float32):
    model = tiny_llama(dtype=dtype)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(scale)
        model.model.layers[1].mlp.down_proj.weight.mul_(scale)
    tmp = tmp_path_factory.mktemp(name)
    dump(tmp, config(task="statistics", exec_range="0,0"),
         lambda: generate(model, prompt_len=4, new_tokens=1))
    return str(tmp)


def test_the_first_divergence_is_drawn_first_and_crossing_points_in_red(tmp_path_factory,
                                                                        tmp_path):
    golden = llama_dump(tmp_path_factory, "golden")
    broken = llama_dump(tmp_path_factory, "broken", scale=3.0)
    write_outputs(compare_dumps(golden, broken), str(tmp_path), xlsx=False)
    image = screenshot(tmp_path / "atb_compare_report.html", tmp_path)
    assert image.shape == (HEIGHT, WIDTH, 3)
    box = pixels(image, DIVERGENCE_BOX)
    assert len(box) > 20_000 and box[:, 0].min() < 150      # a wide box at the top
    red = pixels(image, CROSSING_POINT)
    assert len(red) > 20 and red[:, 0].min() > box[:, 0].max()   # points below it, in the plot
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 50     # text, not a blank page


def test_a_nan_or_inf_found_by_the_scan_is_boxed_and_marked_in_the_plot(tmp_path_factory,
                                                                        tmp_path):
    golden = llama_dump(tmp_path_factory, "fp16", dtype=torch.float16)
    overflow = llama_dump(tmp_path_factory, "fp16_overflow", scale=1e4, dtype=torch.float16)
    write_outputs(compare_dumps(golden, overflow), str(tmp_path), xlsx=False)
    image = screenshot(tmp_path / "atb_compare_report.html", tmp_path)
    assert len(pixels(image, SCAN_BOX)) > 20_000
    mark = pixels(image, SCAN_MARK)
    assert len(mark) >= 20 and mark[:, 0].min() > pixels(image, SCAN_BOX)[:, 0].max()
