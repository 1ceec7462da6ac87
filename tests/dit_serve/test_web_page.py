"""The web page at ``/`` (dit_serve/server/static, dit_serve/server/web.py), driven in a real headless Chromium.

The browser tests use Debian's ``chromium`` and ``chromium-driver`` through Selenium, with the driver's
path given, so Selenium Manager never runs and nothing is downloaded; without them they skip (.ci/run
installs both). One service runs the whole stack (local Ray, a CPU worker with the digits model); a
second, API-only, has an API key, and its test moves the job along through the store as a scheduler
would (lease, commit a PNG), so every authenticated path of the page (the key form, the event stream,
blob images, the archive) is checked without a second worker. Set ``DIT_SERVE_WEB_SCREENSHOT=PATH`` to
also write the job page's screenshot there (docs/web-page.png is made so)."""

from __future__ import annotations

import io
import os
import shutil
import struct
import time
import zipfile

import httpx
import pytest

from dit_serve.server.service import Service

from .conftest import running_service, service_config

KEY = "web-page-admin-key"
DESKTOP = (1100, 760)
PHONE = (390, 844)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- without a browser: the routes -------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(digits_model, tmp_path_factory):
    """An API-only service with an API key (no Ray, no worker)."""
    cfg = service_config(tmp_path_factory.mktemp("web-keyed"), digits_model, server={"api_keys": [KEY]})
    with Service(cfg, roles=("api",)) as svc:
        yield svc


def test_the_page_and_its_assets_need_no_key_and_the_api_still_does(keyed):
    with httpx.Client(base_url=keyed.url, timeout=10) as h:
        page = h.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for name, kind in (("app.js", "text/javascript"), ("api.js", "text/javascript"), ("app.css", "text/css"),
                           ("icon.svg", "image/svg+xml")):
            asset = h.get(f"/static/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind), name
            assert f"/static/{name}" in page.text or name == "api.js"  # api.js is imported by app.js
        for missing in ("/static/nope.js", "/static/..%2Fweb.py", "/static/../api.py"):
            r = h.get(missing)
            assert r.status_code == 404 and "error" in r.json(), missing
        for method, path in (("PUT", "/"), ("POST", "/static/app.js")):
            r = h.request(method, path)
            assert r.status_code == 405 and r.headers["Allow"] == "GET", (method, path)
        assert h.get("/v1/models").status_code == 401
        paths = h.get("/openapi.json").json()["paths"]
        assert "/" not in paths and not any(p.startswith("/static") for p in paths)


# -- a real browser ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no Chromium: apt-get install chromium chromium-driver (.ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service as DriverService

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--hide-scrollbars", f"--window-size={DESKTOP[0]},{DESKTOP[1]}"):
        options.add_argument(arg)
    downloads = tmp_path_factory.mktemp("downloads")
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})
    drv = webdriver.Chrome(service=DriverService(executable_path=driver), options=options)  # no Selenium Manager
    drv.downloads = downloads
    _viewport(drv, DESKTOP)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture(scope="module")
def svc(digits_model, tmp_path_factory, browser):  # the browser first: no Ray started for a test that skips
    with running_service(tmp_path_factory.mktemp("web-svc"), digits_model) as service:
        yield service


def _viewport(drv, size: tuple[int, int], mobile: bool = False) -> None:
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": mobile})


def _wait(drv, cond, timeout: float = 30, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout, poll_frequency=0.1).until(lambda d: cond(d), what)


def _js(drv, script: str, *args):
    return drv.execute_script(script, *args)


def _find(drv, css: str):
    return drv.find_element("css selector", css)


def _fill(drv, css: str, value) -> None:
    field = _find(drv, css)
    field.clear()
    field.send_keys(str(value))


def _submit(drv, labels: str, count: int, steps: int) -> str:
    """Fill the form (digits), submit it, and return the job id the page went to."""
    _wait(drv, lambda d: _js(d, "return document.querySelectorAll('#f-model option').length") > 0, what="models")
    _fill(drv, "#f-label", labels + "\n")  # Enter adds the labels as chips
    _fill(drv, "#f-count", count)
    _fill(drv, "#f-steps", steps)
    _find(drv, "#submit").click()
    _wait(drv, lambda d: d.current_url.split("#", 1)[-1].startswith("/jobs/"), what="the job page")
    return drv.current_url.split("#/jobs/", 1)[1]


def _loaded_images(drv) -> int:
    return _js(drv, "return [...document.querySelectorAll('#grid img')].filter(i => i.complete && "
                    "i.naturalWidth > 0).length")


def _text(drv, css: str) -> str:
    return _js(drv, "return document.querySelector(arguments[0]).textContent", css)


def _no_horizontal_overflow(drv) -> None:
    width, inner = _js(drv, "return [document.documentElement.scrollWidth, innerWidth]")
    assert width <= inner, f"the page is {width} px wide in a {inner} px viewport"


def _js_errors(drv) -> list[str]:
    """Script errors logged by the page (a 401 answer logs a failed resource: that one is expected)."""
    return [e["message"] for e in drv.get_log("browser") if "Failed to load resource" not in e["message"]]


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == PNG_SIGNATURE and png[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", png[16:24])


@pytest.mark.slow
def test_a_job_submitted_from_the_page_fills_its_grid(svc, browser, tmp_path):
    browser.get(f"{svc.url}/")
    job_id = _submit(browser, "three, seven", count=2, steps=25)
    _wait(browser, lambda d: _loaded_images(d) == 4, 60, "four images")
    _wait(browser, lambda d: _text(d, "#j-state") == "done", what="the job's state")
    job = httpx.get(f"{svc.url}/v1/jobs/{job_id}").json()
    assert job["state"] == "done" and [it["label"] for it in job["items"]] == [3, 3, 7, 7]
    cells = _js(browser, "return [...document.querySelectorAll('#grid .cell')].map(c => "
                         "[c.querySelector('.what').textContent, c.querySelector('.state').textContent])")
    assert cells == [["three", "done"], ["three", "done"], ["seven", "done"], ["seven", "done"]]

    png = browser.get_screenshot_as_png()
    (tmp_path / "job.png").write_bytes(png)
    assert _png_size(png) == tuple(_js(browser, "return [innerWidth, innerHeight]")) == DESKTOP
    if target := os.environ.get("DIT_SERVE_WEB_SCREENSHOT"):
        shutil.copyfile(tmp_path / "job.png", target)

    _find(browser, "a[href='#/']").click()  # the list shows it done, with a full bar
    row = f"#jobs li[data-id='{job_id}']"
    _wait(browser, lambda d: _js(d, "const r = document.querySelector(arguments[0]); return r && "
                                    "r.querySelector('.state').textContent === 'done' && "
                                    "r.querySelector('progress').value === 1", row), what="the job's row")
    assert _js_errors(browser) == []


@pytest.mark.slow
def test_a_long_job_shows_live_progress_and_is_cancelled_then_deleted(svc, browser):
    browser.get(f"{svc.url}/")
    job_id = _submit(browser, "1", count=16, steps=1000)
    _wait(browser, lambda d: _text(d, "#j-state") == "running"
          and _js(d, "return document.querySelector('#j-progress').value") > 0, 60, "progress from the events")
    assert _js(browser, "return document.querySelectorAll('#grid .cell').length") == 16
    _find(browser, "#j-cancel").click()
    _wait(browser, lambda d: _text(d, "#j-state") == "cancelled", what="cancelled")
    assert httpx.get(f"{svc.url}/v1/jobs/{job_id}").json()["state"] == "cancelled"
    assert _js(browser, "return document.querySelector('#j-cancel').disabled")

    delete = _find(browser, "#j-delete")
    delete.click()  # the first click asks (the button says so), the second deletes
    assert "?" in delete.text
    delete.click()
    _wait(browser, lambda d: d.current_url.endswith("#/"), what="back to the list")
    assert httpx.get(f"{svc.url}/v1/jobs/{job_id}").status_code == 404
    assert _js_errors(browser) == []


@pytest.mark.slow
def test_on_a_phone_the_form_fits_and_a_job_runs(svc, browser):
    _viewport(browser, PHONE, mobile=True)
    try:
        browser.get(f"{svc.url}/")
        _wait(browser, lambda d: _js(d, "return document.querySelectorAll('#f-model option').length") > 0)
        _no_horizontal_overflow(browser)
        outside = _js(browser, "return [...document.querySelectorAll('#job-form input, #job-form select, "
                               "#job-form button')].filter(e => e.offsetParent && "
                               "e.getBoundingClientRect().right > innerWidth).map(e => e.id)")
        assert outside == []
        _submit(browser, "five", count=1, steps=5)
        _wait(browser, lambda d: _loaded_images(d) == 1, 60, "the image")
        _wait(browser, lambda d: _text(d, "#j-state") == "done")
        _no_horizontal_overflow(browser)
        assert _png_size(browser.get_screenshot_as_png()) == PHONE
    finally:
        _viewport(browser, DESKTOP)


def _run_as_a_worker(store, job_id: str, n: int) -> None:
    """Lease the job's n items and commit an 8x8 PNG for each, as a worker would."""
    from PIL import Image

    leases = sorted(store.lease("test-web", ["digits"], n, 60.0), key=lambda ls: ls.index)
    assert [(ls.job_id, ls.index) for ls in leases] == [(job_id, i) for i in range(n)]
    for lease in leases:
        buf = io.BytesIO()
        Image.new("L", (8, 8), 40 + 50 * lease.index).save(buf, format="PNG")
        assert store.commit_result(lease, buf.getvalue())


def test_with_an_api_key_the_page_asks_for_it_once_then_works(keyed, browser):
    browser.get(f"{keyed.url}/")
    _wait(browser, lambda d: _js(d, "return !document.querySelector('#key-view').hidden"), what="the key form")
    _fill(browser, "#key-input", "not-the-key\n")
    _wait(browser, lambda d: "refused" in _text(d, "#key-error"), what="the refusal")
    _fill(browser, "#key-input", KEY + "\n")
    _wait(browser, lambda d: _js(d, "return document.querySelectorAll('#f-model option').length") > 0)
    assert _js(browser, "return sessionStorage.getItem('dit-serve.api-key')") == KEY
    browser.refresh()  # kept for the tab: not asked again
    job_id = _submit(browser, "two", count=2, steps=5)
    assert _js(browser, "return document.querySelector('#key-view').hidden")

    _wait(browser, lambda d: _text(d, "#j-state") == "queued")
    _run_as_a_worker(keyed.store, job_id, 2)
    _wait(browser, lambda d: _loaded_images(d) == 2, what="two images, fetched with the key")
    assert _js(browser, "return [...document.querySelectorAll('#grid img')].every(i => i.src.startsWith('blob:'))")
    _wait(browser, lambda d: _text(d, "#j-state") == "done")

    _find(browser, "#j-download").click()
    archive = browser.downloads / f"{job_id}.zip"
    _wait(browser, lambda d: archive.exists(), what="the archive")
    assert sorted(zipfile.ZipFile(archive).namelist()) == ["00000.png", "00001.png", "manifest.json"]
    assert _js_errors(browser) == []


def test_the_event_parser_joins_lines_split_across_chunks(keyed, browser):
    """api.js's text/event-stream parser, fed chunks that cut a field, a line and a \\r\\n in two."""
    browser.get(f"{keyed.url}/static/icon.svg")  # any page of the origin, to import the module from
    chunks = ['retry: 500\r\n\r\nevent: progress\nid: 0.1\nda', 'ta: {"a": 1}\r', '\n\n: keep-alive\n\n',
              'event: item\ndata: x\r', '\ndata:y\n\nevent: end\ndata: unfinished']  # the last event never ends
    events = browser.execute_async_script("""
        const [chunks, done] = arguments;
        import('/static/api.js').then(async ({ parseEvents }) => {
          const bytes = new TextEncoder();
          const body = new ReadableStream({ start(c) { chunks.forEach(s => c.enqueue(bytes.encode(s))); c.close(); } });
          const out = [];
          for await (const ev of parseEvents(body)) out.push(ev);
          done(out);
        }, e => done(String(e)));""", chunks)
    assert events == [{"retry": 500}, {"event": "progress", "id": "0.1", "data": '{"a": 1}'},
                      {"event": "item", "data": "x\ny"}]


def test_without_the_event_stream_the_job_page_polls(keyed, browser):
    """A stream that cannot be had (here: blocked in the browser) is retried, then the job is polled."""
    r = httpx.post(f"{keyed.url}/v1/jobs", json={"labels": [4, 9]}, headers={"Authorization": f"Bearer {KEY}"})
    job_id = r.json()["id"]
    browser.get(f"{keyed.url}/")
    browser.execute_script("sessionStorage.setItem('dit-serve.api-key', arguments[0])", KEY)
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/events"]})
    try:
        browser.get(f"{keyed.url}/#/jobs/{job_id}")
        _wait(browser, lambda d: _text(d, "#j-state") == "queued")
        _run_as_a_worker(keyed.store, job_id, 2)
        _wait(browser, lambda d: _loaded_images(d) == 2, 20, "two images, found by polling")
        assert _text(browser, "#j-state") == "done"
    finally:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
        browser.execute_cdp_cmd("Network.disable", {})


@pytest.mark.slow
def test_previews_show_in_the_grid_while_a_job_denoises(svc, browser):
    browser.get(f"{svc.url}/")
    _wait(browser, lambda d: _js(d, "return document.querySelectorAll('#f-model option').length") > 0, what="models")
    _fill(browser, "#f-preview", 5)  # once the form is shown (after the models arrive)
    job_id = _submit(browser, "4", count=4, steps=1000)
    assert httpx.get(f"{svc.url}/v1/jobs/{job_id}").json()["params"]["preview_every"] == 5
    _wait(browser, lambda d: _js(d, "return [...document.querySelectorAll('#grid .cell.preview img')].filter("
                                    "i => i.complete && i.naturalWidth > 0).length") > 0, 60, "a preview in a cell")
    _find(browser, "#j-cancel").click()
    _wait(browser, lambda d: _text(d, "#j-state") == "cancelled", what="cancelled")
    assert _js_errors(browser) == []


def test_a_failed_jobs_reasons_are_visible_text_and_a_cancel_keeps_its_progress(keyed, browser):
    auth = {"Authorization": f"Bearer {KEY}"}
    failed = httpx.post(f"{keyed.url}/v1/jobs", json={"labels": [1, 2, 3], "priority": 100}, headers=auth).json()["id"]
    leases = sorted(keyed.store.lease("test-web", ["digits"], 3, 60.0), key=lambda ls: ls.index)
    assert [(ls.job_id, ls.index) for ls in leases] == [(failed, i) for i in range(3)]
    for lease, why in zip(leases, ["out of memory", "out of memory", "plan is degenerate"]):
        assert keyed.store.fail_item(lease, why)
    browser.get(f"{keyed.url}/")
    browser.execute_script("sessionStorage.setItem('dit-serve.api-key', arguments[0])", KEY)
    browser.get(f"{keyed.url}/#/jobs/{failed}")
    _wait(browser, lambda d: _text(d, "#j-state") == "failed", what="failed")
    _wait(browser, lambda d: _js(d, "return [...document.querySelectorAll('#j-failures li')].map(li => "
                                    "li.textContent)") == ["2 items failed (first: #0): out of memory",
                                                           "1 item failed (first: #2): plan is degenerate"],
          what="the reasons")
    # shown as text in each cell (seen on a phone too), not only as a tooltip
    assert _js(browser, "return [...document.querySelectorAll('#grid .cell .why')].map(w => "
                        "w.offsetParent !== null && w.textContent)") == ["out of memory", "out of memory",
                                                                         "plan is degenerate"]
    assert _js(browser, "return document.querySelector('#j-download').disabled")  # no images to download

    running = httpx.post(f"{keyed.url}/v1/jobs", json={"labels": [4], "steps": 100, "priority": 100},
                         headers=auth).json()["id"]
    (lease,) = keyed.store.lease("test-web", ["digits"], 1, 60.0)
    assert lease.job_id == running
    lease.step = 40
    assert keyed.store.heartbeat([lease], 60.0) == []
    browser.get(f"{keyed.url}/#/jobs/{running}")
    _wait(browser, lambda d: _text(d, "#j-state") == "running"
          and _js(d, "return document.querySelector('#j-progress').value") == 0.4, what="40 of 100 steps")
    _find(browser, "#j-cancel").click()
    _wait(browser, lambda d: _text(d, "#j-state") == "cancelled", what="cancelled")
    time.sleep(0.5)  # the end event's and the last read's renders
    assert _js(browser, "return [document.querySelector('#j-progress').value, "
                        "document.querySelector('#grid .cell progress').value]") == [0.4, 0.4]
    assert _js_errors(browser) == []


def test_an_edit_picks_an_image_paints_a_mask_and_shows_the_result_beside_the_input(keyed, browser, tmp_path):
    """The form's image and the brush on its canvas become the job's image and mask (white where painted, at the
    image's own size); the job's page shows the input and the mask before the results."""
    from PIL import Image
    from selenium.webdriver.common.action_chains import ActionChains

    source = tmp_path / "three.png"
    Image.new("L", (8, 8), 90).save(source)
    browser.get(f"{keyed.url}/")
    browser.execute_script("sessionStorage.setItem('dit-serve.api-key', arguments[0])", KEY)
    browser.get(f"{keyed.url}/")
    _wait(browser, lambda d: _js(d, "return !document.querySelector('#edit-field').hidden"), what="the edit field")
    assert _js(browser, "return document.querySelector('#mask-editor').hidden")
    _find(browser, "#f-image").send_keys(str(source))
    _wait(browser, lambda d: _js(d, "return !document.querySelector('#mask-editor').hidden"), what="the canvas")
    canvas = _find(browser, "#f-mask")
    assert _js(browser, "const c = arguments[0]; return [c.width, c.height]", canvas) == [8, 8]
    box = _js(browser, "const r = arguments[0].getBoundingClientRect(); return [r.width, r.height]", canvas)
    _fill(browser, "#f-brush", "")
    _js(browser, "document.querySelector('#f-brush').value = 5")  # a brush of about a pixel at 8 px
    left = -box[0] / 2 + box[0] / 16  # the canvas's left column, from its centre, top to bottom
    ActionChains(browser).move_to_element_with_offset(canvas, left, -box[1] / 2 + 2).click_and_hold() \
        .move_by_offset(0, box[1] / 2).move_by_offset(0, box[1] / 2 - 4).release().perform()
    _fill(browser, "#f-strength", "0.8")
    job_id = _submit(browser, "three", count=1, steps=5)

    auth = {"Authorization": f"Bearer {KEY}"}
    params = httpx.get(f"{keyed.url}/v1/jobs/{job_id}", headers=auth).json()["params"]
    assert params["strength"] == 0.8 and params["image"]["width"] == params["mask"]["width"] == 8
    mask = Image.open(io.BytesIO(httpx.get(f"{keyed.url}/v1/jobs/{job_id}/inputs/mask", headers=auth).content))
    column = [mask.convert("L").getpixel((0, y)) for y in range(8)]
    assert column.count(255) >= 6 and mask.convert("L").getpixel((7, 4)) == 0, column  # painted left, kept right
    _run_as_a_worker(keyed.store, job_id, 1)
    _wait(browser, lambda d: _loaded_images(d) == 3, what="the input, the mask and the result")
    cells = _js(browser, "return [...document.querySelectorAll('#grid .cell')].map(c => "
                         "c.querySelector('.what').textContent)")
    assert cells == ["input, strength 0.8", "mask", "three"]
    assert "inpainting" in _text(browser, "#j-summary")
    assert _js_errors(browser) == []


@pytest.mark.slow
def test_the_page_lists_the_workers_and_the_models_they_hold(svc, browser):
    """The job list's page shows each worker (``GET /v1/workers``): its name, state and the models it holds."""
    browser.get(f"{svc.url}/")
    _wait(browser, lambda d: _js(d, "return document.querySelectorAll('#workers li').length") == 1, what="a worker")
    _wait(browser, lambda d: "ready" in _text(d, "#workers li"), what="it is ready")
    assert _text(browser, "#workers li").startswith("worker-cpu-0ready" + "digits")
    assert _js(browser, "return document.querySelector('#workers-empty').hidden")
    assert _js_errors(browser) == []


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """An API-only service of digits-text with an API key and adapters on (no Ray, no worker)."""
    cfg = service_config(tmp_path_factory.mktemp("web-loras"), "digits-text", server={"api_keys": [KEY]},
                         workers={"lora_slots": 2})
    with Service(cfg, roles=("api",)) as svc:
        yield svc


def test_the_form_lists_the_models_adapters_and_a_job_applies_the_ones_typed(adapted, browser):
    """An adapter registered for the model shows in the form (name and rank, offered as the field's completions);
    ``name:scale`` typed there becomes the job's ``loras``; a scale the service refuses is shown as its message,
    the field marked, and no job made."""
    from pathlib import Path

    thick = Path(__file__).resolve().parents[2] / "workers" / "models" / "digits-text-thick.safetensors"
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{adapted.url}/v1/loras", headers=auth, data={"name": "thick", "model": "digits-text"},
                   files={"file": ("thick.safetensors", thick.read_bytes())})
    assert r.status_code == 201, r.text
    browser.get(f"{adapted.url}/")
    browser.execute_script("sessionStorage.setItem('dit-serve.api-key', arguments[0])", KEY)
    browser.get(f"{adapted.url}/")
    _wait(browser, lambda d: "thick" in _text(d, "#lora-list"), what="the adapter listed")
    assert _text(browser, "#lora-list") == "Adapters: thick (rank 4)"
    assert _js(browser, "return [...document.querySelectorAll('#lora-names option')].map(o => o.value)") == ["thick"]
    _fill(browser, "#f-prompts", "a bold 3")
    _fill(browser, "#f-count", 1)
    _fill(browser, "#f-steps", 5)
    _fill(browser, "#f-loras", "thick:9")
    _find(browser, "#submit").click()
    _wait(browser, lambda d: "thick" in _text(d, "#form-error"), what="the refusal")
    assert "scale 9 is outside [-4, 4]" in _text(browser, "#form-error")
    assert _js(browser, "return document.querySelector('#f-loras').getAttribute('aria-invalid')") == "true"
    assert httpx.get(f"{adapted.url}/v1/jobs", headers=auth).json()["data"] == []
    _fill(browser, "#f-loras", "thick:0.6")
    _find(browser, "#submit").click()
    _wait(browser, lambda d: d.current_url.split("#", 1)[-1].startswith("/jobs/"), what="the job page")
    job_id = browser.current_url.split("#/jobs/", 1)[1]
    params = httpx.get(f"{adapted.url}/v1/jobs/{job_id}", headers=auth).json()["params"]
    assert [(u["name"], u["scale"]) for u in params["loras"]] == [("thick", 0.6)]
    assert len(params["loras"][0]["sha256"]) == 64
    assert _js_errors(browser) == []
