"""`fsdpjob report RUN --html FILE` (views/report/html.py, templates/report.html.j2): one self-contained page
from a run folder of recorded events (no training), its user strings escaped, bad output paths refused in one
line, and the page opened in a real headless browser (Debian's chromium): no console error, the picture shows."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import run_cli
from test_report_picture import EVENTS, METRICS

from fsdpjob.orchestrator import registry
from fsdpjob.orchestrator.registry import JobRecord

HOSTILE = "r<script>alert(1)</script>&\"'"


def run_folder(tmp_path: Path, run_id: str = "html-1") -> JobRecord:
    """A finished local run (its controller long gone) whose folder holds the recorded events and metrics."""
    run_dir = tmp_path / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    rec = JobRecord(run_id=run_id, name="html", run_dir=str(run_dir), scheduler="local", job_id="999999999",
                    profile="local", submitted_at=0.0, spec_hash="h", nodes=1, tasks_per_node=2, max_steps=20,
                    gpus_per_node=0, extra={"cancelled": True})
    registry.save(rec)
    return rec


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Path, int, str, str]:
    """`fsdpjob report RUN --html FILE --plot FILE` once for this module (drawing takes seconds): the page, the
    PNG, the exit code, stdout and stderr."""
    tmp = tmp_path_factory.mktemp("report")
    page_file, plot_file = tmp / "report.html", tmp / "report.png"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSDPJOB_HOME", str(tmp / "home"))  # the per-test home is not there yet in a module fixture
        rec = run_folder(tmp)
        code, out, err = run_cli("report", rec.run_id, "--html", str(page_file), "--plot", str(plot_file))
    return page_file, plot_file, code, out, err


def test_html_is_one_self_contained_page_with_the_picture_breakdown_and_interruptions(written):
    page_file, plot_file, code, out, err = written
    assert code == 0, err
    assert f"html: {page_file}" in err and "goodput" in out  # the text report still prints
    html = page_file.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    # Self-contained: no URL to fetch, no script; the picture is the PNG --plot wrote, inline.
    [src] = re.findall(r'<img id="picture-img"[^>]* src="data:image/png;base64,([^"]+)"', html)
    assert not re.search(r"(?i)(https?:|//[a-z]|<script|<link|@import|url\()", html.replace(src, ""))
    assert base64.b64decode(src) == plot_file.read_bytes()
    for part in ("start-up", "productive", "checkpoint saves", "lost work", "unexplained"):
        assert f"<td>{part}</td>" in html, part
    # The interruptions as the run's events say: a preemption and the user's cancel, no crash.
    stops = re.findall(r'<td class="stop (\w+)">([^<]+)</td>', html)
    assert stops == [("preemption", "preempted"), ("cancel", "cancelled")], stops


def test_user_strings_are_escaped(tmp_path):
    from fsdpjob.orchestrator.views.report.html import page
    from fsdpjob.orchestrator.views.report.run import run_report

    rec = run_folder(tmp_path, run_id="x")
    rec.run_id = HOSTILE  # a run id as hostile as a name could make it, and a job's error text
    result = run_report(rec)
    result.warnings.append(f"scheduler said {HOSTILE}")
    html = page(result, b"\x89PNG", "local")
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;&amp;&#34;&#39;" in html


@pytest.mark.parametrize("option", ["--html", "--plot"])
def test_an_output_file_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, option):
    rec = run_folder(tmp_path)
    code, out, err = run_cli("report", rec.run_id, option, str(tmp_path / "nodir" / "x.out"))
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"{option}: cannot write {tmp_path / 'nodir' / 'x.out'}: there is no folder "
                                f"{tmp_path / 'nodir'}; create it first or name a file in a folder that exists"]
    code, out, err = run_cli("report", rec.run_id, option, str(tmp_path))
    assert (code, out, err) == (2, "", f"{option}: {tmp_path} is a folder; name a file to write\n")
    # A write that fails (here a full disk: /dev/full, which refuses root too) is the user's to fix, in one line.
    code, out, err = run_cli("report", rec.run_id, option, "/dev/full")
    assert (code, out, err) == (2, "", f"{option}: cannot write /dev/full: No space left on device\n")


def test_plot_and_html_naming_one_file_is_refused(tmp_path, monkeypatch):
    """Both outputs are written, the page last: one file for both would keep only the page."""
    rec = run_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("report", rec.run_id, "--plot", "F", "--html", str(tmp_path / "F"))
    assert (code, out) == (2, "") and err == f"--html: {tmp_path / 'F'} is also --plot's file; give the page and the " \
                                             "picture two files\n", err
    assert not (tmp_path / "F").exists()


@pytest.fixture
def chromium() -> str:
    """Debian's chromium: the test skips without it, or fails under FSDPJOB_REQUIRE_BROWSER=1 (.ci/run)."""
    path = shutil.which("chromium")
    if path is None:
        reason = "Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)"
        if os.environ.get("FSDPJOB_REQUIRE_BROWSER") == "1":
            pytest.fail(f"FSDPJOB_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    return path


def test_the_page_opens_in_a_headless_browser_without_errors_and_shows_the_picture(chromium, tmp_path, written):
    from matplotlib.image import imread
    from playwright.sync_api import sync_playwright

    good = written[0]
    # The control: the same page with its picture pointing at a missing file must be caught.
    broken = tmp_path / "broken.html"
    broken.write_text(re.sub(r'src="data:[^"]+"', 'src="missing.png"', good.read_text()))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])  # root: no user namespace
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            seen = {}
            for name, path in (("good", good), ("broken", broken)):
                errors.clear()
                page.goto(path.as_uri(), wait_until="load")
                img = page.locator("#picture-img")
                width = img.evaluate("i => i.complete ? i.naturalWidth : 0")
                seen[name] = (list(errors), width, img.is_visible(), img.screenshot() if width else b"")
        finally:
            browser.close()
    errors, width, visible, shot = seen["good"]
    assert errors == [] and visible and width >= 1000, (errors, width, visible)
    pixels = imread(io.BytesIO(shot))[..., :3]
    drawn = (pixels.min(axis=-1) < 0.9).mean()  # not white: lines, bands, bars, text
    assert drawn > 0.05, drawn
    errors, width, _, _ = seen["broken"]
    assert width == 0 and any("ERR_FILE_NOT_FOUND" in e or "Failed to load resource" in e for e in errors), errors
