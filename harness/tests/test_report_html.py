"""The self-contained HTML reports open in a real browser (headless Chromium, Debian's `chromium` package) with
their pictures drawn: a screenshot of each page holds the figures' own colours, and a page whose picture is
taken away does not (so the check can fail). Skipped where Chromium is not installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from benchkit import write_fake_run
from hybridkv_bench.report.compare import compare
from hybridkv_bench.report.markdown import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium: apt-get install -y chromium")
TAB_BLUE, TAB_ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's first two colours: the bars


def screenshot(page: Path, out: Path, height: int, scale: float = 1.0) -> Path:
    """The page as headless Chromium draws it, in a 1400 px wide window `height` px tall (CSS pixels; the
    picture has `scale` device pixels per CSS pixel: a long page is cheaper to shoot small)."""
    assert CHROMIUM is not None
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--allow-file-access-from-files", f"--window-size=1400,{height}",
                        f"--force-device-scale-factor={scale}", f"--screenshot={out}", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and out.exists(), r.stderr
    return out


def pixels_near(png: Path, colour: tuple[int, int, int], tol: int = 12) -> int:
    """How many pixels of the screenshot are within `tol` of `colour` in every channel."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return int((np.abs(rgb - np.array(colour)) <= tol).all(axis=2).sum())


def test_compare_html_renders_its_picture(tmp_path: Path, smoke):
    a = write_fake_run(tmp_path / "a", smoke, max_cases=4)
    b = write_fake_run(tmp_path / "b", smoke, max_cases=4, seed=1)
    compare([str(a), str(b)], tmp_path / "cmp")
    page = tmp_path / "cmp" / "compare.html"
    (tmp_path / "cmp" / "compare.png").unlink()  # what the browser draws must come from inside the page
    shot = screenshot(page, tmp_path / "shot.png", 2000)
    assert pixels_near(shot, TAB_BLUE) > 2000 and pixels_near(shot, TAB_ORANGE) > 2000
    # the same page with its picture taken out: no bars drawn, so the count above measured the picture
    bare = tmp_path / "cmp" / "bare.html"
    text = page.read_text()
    start = text.index('src="data:image/png;base64,') + len('src="')
    bare.write_text(text[:start] + "missing.png" + text[text.index('"', start):])
    assert pixels_near(screenshot(bare, tmp_path / "bare.png", 2000), TAB_BLUE) < 50


@pytest.mark.slow  # 8 s on the 2-core VM: `nox -s tests_slow` runs it
def test_report_html_renders_every_figure(tmp_path: Path, run_folder: Path):
    import re

    import numpy as np
    from PIL import Image

    write_report(run_folder, tmp_path / "rep")
    for png in (tmp_path / "rep").glob("*.png"):
        png.unlink()  # only the copies inside report.html remain
    page = tmp_path / "rep" / "report.html"
    text = page.read_text()
    tags = re.findall(r'<img src="data:image/png;base64,[^"]+"[^>]*>', text)
    assert len(tags) == 4  # ttft, throughput, server, policies
    # the whole page as a reader scrolls it: the bars are drawn ...
    assert pixels_near(screenshot(page, tmp_path / "shot.png", 16000, 0.25), TAB_BLUE) > 1000
    # ... and come from its pictures: without them, none
    bare = tmp_path / "rep" / "bare.html"
    bare.write_text(re.sub(r'src="data:image/png;base64,[^"]+"', 'src="missing.png"', text))
    assert pixels_near(screenshot(bare, tmp_path / "bare.png", 16000, 0.25), TAB_BLUE) < 20
    # each picture on its own, one 500 px band apiece (the page's own tags, verbatim): every one draws its bars
    bands = tmp_path / "rep" / "bands.html"
    sized = [t.replace("<img ", "<img style='height:480px' ") for t in tags]
    bands.write_text("<!doctype html><body style='margin:0'>" + "".join(
        f"<div style='height:500px;overflow:hidden'>{t}</div>" for t in sized) + "</body>")
    rgb = np.asarray(Image.open(screenshot(bands, tmp_path / "bands.png", 2000)).convert("RGB")).astype(int)
    blue = (np.abs(rgb - np.array(TAB_BLUE)) <= 12).all(axis=2)
    for i in range(4):
        assert blue[i * 500:(i + 1) * 500].sum() > 500, f"picture {i} of report.html drew no bars"
