"""The web console (h3serve/gateway/http/console/) in a real headless Chromium, driven by Playwright, against the
real four-process stack's HTTP door: t2va with a live progress bar, playback, download, bin and restore,
re-run; fl2va with an uploaded keyframe; the server's messages for a refused upload and a refused request;
the bearer-token field; keyframe labels that a failed upload leaves as the prompt names them; a seed that does
not carry over to the next job unless typed; the adapter picker, against a second stack whose DiT loads tiny LoRA
adapters (listed by the door's GET /v1/models from the DiT's own Info).

Screenshots of each state land in the test's tmp dir (the path is printed); with H3SERVE_DOCS_SCREENSHOTS=1 the
final ones are also copied to docs/images/console-*.png, docs/http.md's pictures.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium's own connections are refused by a closed network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
DOCS_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
JOB_TIMEOUT_MS = 180_000  # a 64x32, 8-step job on a shared CPU takes seconds; the first one also warms up
SMALL = {"size": "64x32", "steps": "8"}

# Records, per job card, every value its progress bar and its status detail took (the oldValue chain of the
# bar's aria-valuenow, the text nodes the status detail was given), so the test sees the bar move live.
RECORDER = """() => {
  window.__seen = {};
  const cardOf = (node) => {
    const el = node.nodeType === 1 ? node : node.parentElement;
    return el && el.closest ? el.closest("[data-job-id]") : null;
  };
  new MutationObserver((records) => {
    for (const r of records) {
      const card = cardOf(r.target);
      if (!card) continue;
      const seen = (window.__seen[card.dataset.jobId] ||= {progress: [], detail: []});
      if (r.type === "attributes") {
        if (r.oldValue !== null) seen.progress.push(Number(r.oldValue));
        seen.progress.push(Number(r.target.getAttribute("aria-valuenow")));
      } else if (r.target.classList && r.target.classList.contains("status-detail")) {
        for (const node of r.addedNodes) seen.detail.push(node.textContent);
      }
    }
  }).observe(document.querySelector("#job-list"), {subtree: true, childList: true, attributes: true,
                                                  attributeFilter: ["aria-valuenow"], attributeOldValue: true});
}"""


# ---------------------------------------------------------------- helpers


def call(
    base: str,
    method: str,
    path: str,
    body: dict | None = None,
    *,
    data: bytes | None = None,
    content_type: str | None = None,
) -> tuple[int, dict]:
    """One HTTP call to the door, without the browser: (status, JSON body)."""
    if body is not None:
        data, content_type = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(base + path, data=data, method=method)
    if content_type:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def upload(base: str, name: str, payload: bytes, mime: str) -> tuple[int, dict]:
    boundary = uuid.uuid4().hex
    data = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f"Content-Type: {mime}\r\n\r\n"
        ).encode()
        + payload
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return call(base, "POST", "/v1/assets", data=data, content_type=f"multipart/form-data; boundary={boundary}")


def content(base: str, job_id: str) -> bytes:
    with urllib.request.urlopen(f"{base}/v1/videos/{job_id}/content", timeout=60) as response:
        return response.read()


def first_messages(base: str, job_id: str, count: int) -> bytes:
    """The first `count` messages of a job's event stream, as the server sent them; the connection is then closed."""
    messages = []
    with urllib.request.urlopen(f"{base}/v1/videos/{job_id}/events", timeout=60) as response:
        message = b""
        while len(messages) < count:
            line = response.readline()
            assert line, "the stream ended early"
            message += line
            if line in (b"\n", b"\r\n"):
                if not message.startswith(b":"):
                    messages.append(message)
                message = b""
    return b"".join(messages)


def shot(page, shots: Path, name: str, docs: bool = False, toast: bool = True) -> Path:
    """A screenshot of the page in the test's tmp dir; `docs` also copies it to docs/images/console-<name>.png;
    `toast=False` hides a passing notice first."""
    if not toast:
        page.evaluate("document.querySelector('#toast').hidden = true")
    path = shots / f"console-{name}.png"
    page.screenshot(path=str(path))
    if docs and os.environ.get("H3SERVE_DOCS_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_IMAGES / path.name)
    return path


def card(page, job_id: str):
    return page.locator(f'#job-list [data-job-id="{job_id}"]')


def submit_sent(page) -> tuple[dict, dict]:
    """Click Generate; (the JSON body the console sent, the Video object the gateway answered)."""
    with page.expect_response(lambda r: r.url.endswith("/v1/videos") and r.request.method == "POST") as answer:
        page.click("#submit")
    assert answer.value.status == 200, answer.value.text()
    return answer.value.request.post_data_json, answer.value.json()


def submit(page) -> dict:
    """Click Generate; the Video object the gateway answered."""
    return submit_sent(page)[1]


def cancel(base: str, *job_ids: str) -> None:
    """Cancel jobs a test needed only submitted (one already finished stays as it is): the shared CPU is spared."""
    for job_id in job_ids:
        call(base, "POST", f"/v1/videos/{job_id}/cancel")


def wait_completed(page, job_id: str) -> None:
    from playwright.sync_api import expect

    job = card(page, job_id)
    expect(job).to_have_attribute("data-status", re.compile("completed|failed|cancelled"), timeout=JOB_TIMEOUT_MS)
    assert job.get_attribute("data-status") == "completed", job.locator("[data-testid=job-status]").inner_text()
    expect(job.locator("[data-testid=job-progress]")).to_have_attribute("aria-valuenow", "100")
    expect(job.locator(".status-word")).to_have_text("completed")


def fill_form(
    page, workflow: str, prompt: str, size: str = "", seconds: str = "", steps: str = "", seed: str = ""
) -> None:
    page.check(f"#wf-{workflow}")
    page.fill("#prompt", prompt)
    page.fill("#size", size)
    page.fill("#seconds", seconds)
    page.fill("#steps", steps)
    page.fill("#seed", seed)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def base(stack) -> str:
    return stack.http.rstrip("/")


@pytest.fixture
def shots(tmp_path) -> Path:
    path = tmp_path / "screenshots"
    path.mkdir()
    return path


@contextlib.contextmanager
def console(browser, base: str):
    """A fresh browser context (own localStorage) on the console at `base`; fails the test on an uncaught page
    error."""
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    context.set_default_timeout(30_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(base + "/")
    page.wait_for_selector("#health[data-state=serving]", timeout=60_000)
    page.evaluate(RECORDER)
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def page(browser, base):
    with console(browser, base) as page:
        yield page


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(900)
def test_t2va_progress_play_download_bin_restore_rerun(page, base, shots):
    from playwright.sync_api import expect

    shot(page, shots, "start")
    fill_form(page, "t2va", "a kite over the dunes at noon", **SMALL)
    shot(page, shots, "form", docs=True)
    video = submit(page)
    job_id = video["id"]
    assert video["h3serve"]["width"] == 64 and video["h3serve"]["height"] == 32 and video["h3serve"]["steps"] == 8
    job = card(page, job_id)
    expect(job).to_be_visible()
    assert page.locator("#job-list [data-testid=job]").first.get_attribute("data-job-id") == job_id  # newest first

    wait_completed(page, job_id)
    seen = page.evaluate("id => window.__seen[id]", job_id)
    assert any(0 < value < 100 for value in seen["progress"]), seen  # the bar moved through the stages
    assert seen["progress"][-1] == 100
    assert any(text.startswith("denoising ") and re.search(r"\d+/\d+", text) for text in seen["detail"]), seen
    shot(page, shots, "completed")

    # inline playback: the MP4 fetched as a blob with the auth header, played from an object URL
    job.locator("[data-testid=job-play]").click()
    player = job.locator("[data-testid=job-video]")
    expect(player).to_be_visible()
    player.evaluate("v => v.pause()")
    page.wait_for_function("v => v.readyState >= 2 && v.duration > 0", arg=player.element_handle(), timeout=30_000)
    assert player.evaluate("v => v.src").startswith("blob:")
    assert player.evaluate("v => v.videoWidth") == 64

    # download: saved with the server's file name, the same bytes the API serves
    with page.expect_download() as download_info:
        job.locator("[data-testid=job-download]").click()
    download = download_info.value
    assert download.suggested_filename == f"h3-{job_id}.mp4"
    saved = shots / download.suggested_filename
    download.save_as(str(saved))
    assert saved.read_bytes() == content(base, job_id)
    assert saved.read_bytes()[4:8] == b"ftyp"

    # a refresh keeps the cards still listed, the loaded player with them
    with page.expect_response(lambda r: "/v1/videos?" in r.url):
        page.click("#refresh")
    expect(page.locator("#job-list")).not_to_have_attribute("aria-busy", "true")
    assert player.evaluate("v => v.src.startsWith('blob:') && v.readyState >= 2")

    # delete: the job leaves the list for the bin; restore brings it back
    job.locator("[data-testid=job-delete]").click()
    expect(job).to_have_count(0)
    expect(page.locator("#toast")).to_contain_text("bin")
    assert call(base, "GET", f"/v1/videos/{job_id}")[1]["deleted_at"]
    page.click("#tab-bin")
    expect(page.locator("#tab-bin")).to_have_attribute("aria-selected", "true")
    binned = card(page, job_id)
    expect(binned).to_be_visible()
    expect(binned.locator("[data-testid=job-restore]")).to_be_visible()
    expect(binned.locator("[data-testid=job-delete]")).to_be_hidden()
    shot(page, shots, "bin", docs=True)
    binned.locator("[data-testid=job-restore]").click()
    expect(binned).to_have_count(0)
    assert call(base, "GET", f"/v1/videos/{job_id}")[1]["deleted_at"] is None
    page.click("#tab-jobs")
    job = card(page, job_id)
    expect(job).to_be_visible()
    expect(job).to_have_attribute("data-status", "completed")

    # re-run: the form takes the job's parameters and a second job with the same ones runs to the end
    page.fill("#prompt", "something else entirely")
    with page.expect_response(lambda r: r.url.endswith("/v1/videos") and r.request.method == "POST") as answer:
        job.locator("[data-testid=job-rerun]").click()
    rerun = answer.value.json()
    assert rerun["id"] != job_id
    expect(page.locator("#prompt")).to_have_value("a kite over the dunes at noon")
    expect(page.locator("#size")).to_have_value("64x32")
    expect(page.locator("#steps")).to_have_value("8")
    wait_completed(page, rerun["id"])
    assert page.locator("#job-list [data-testid=job]").first.get_attribute("data-job-id") == rerun["id"]
    first, second = (call(base, "GET", f"/v1/videos/{i}")[1] for i in (job_id, rerun["id"]))
    assert second["prompt"] == first["prompt"]
    assert second["size"] == first["size"] == "64x32"
    for key in ("workflow", "steps", "seed", "num_frames", "width", "height"):
        assert second["h3serve"][key] == first["h3serve"][key], key  # the seed too: all 63 bits of it
    for shown in (job_id, rerun["id"]):  # both players, paused a second in, for docs/http.md's picture
        card(page, shown).locator("[data-testid=job-play]").click()
        player = card(page, shown).locator("[data-testid=job-video]").element_handle()
        page.wait_for_function("v => v.readyState >= 2 && v.duration > 0", arg=player)
        player.evaluate("v => { v.pause(); v.currentTime = Math.min(1, v.duration / 2); }")
        page.wait_for_function("v => !v.seeking && v.readyState >= 2", arg=player)
    shot(page, shots, "jobs", docs=True, toast=False)


@pytest.mark.timeout(600)
def test_fl2va_keyframe_upload_and_upload_error(page, base, shots, tmp_path):
    from PIL import Image
    from playwright.sync_api import expect

    keyframe = tmp_path / "first.png"
    image = Image.new("RGB", (64, 32))
    image.putdata([(x * 4, y * 8, 160) for y in range(32) for x in range(64)])
    image.save(keyframe)

    page.check("#wf-fl2va")
    expect(page.locator("#fl2va-fields")).to_be_visible()
    expect(page.locator("#ref2va-fields")).to_be_hidden()

    # a file the gateway refuses: the chip and the form say the server's own message
    refused = b"these are notes, not an image\n"
    status, answer = upload(base, "notes.txt", refused, "text/plain")
    assert 400 <= status < 500, (status, answer)
    message = answer["error"]["message"]
    page.set_input_files("#last-frame-file", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": refused}])
    bad_chip = page.locator("#last-frame-asset [data-testid=asset]")
    expect(bad_chip).to_have_attribute("data-state", "error")
    expect(bad_chip.locator("[data-testid=asset-info]")).to_have_text(message)
    expect(page.locator("#form-error")).to_be_visible()
    expect(page.locator("#form-error")).to_contain_text(message)
    shot(page, shots, "upload-error")
    bad_chip.locator("[data-testid=asset-remove]").click()
    expect(bad_chip).to_have_count(0)

    # the keyframe: uploaded at once, described, labelled <Picture 1>
    page.set_input_files("#first-frame-file", str(keyframe))
    chip = page.locator("#first-frame-asset [data-testid=asset]")
    expect(chip).to_have_attribute("data-state", "ready")
    asset_id = chip.get_attribute("data-asset-id")
    assert asset_id
    expect(chip.locator("[data-testid=asset-info]")).to_contain_text("64×32")
    expect(chip.locator("[data-testid=asset-label]")).to_have_text("<Picture 1>")
    page.fill("#prompt", "")
    chip.locator("[data-testid=asset-label]").click()  # inserts the label into the prompt
    page.locator("#prompt").press_sequentially("slowly drifts out to sea")
    expect(page.locator("#prompt")).to_have_value("<Picture 1> slowly drifts out to sea")
    page.fill("#size", SMALL["size"])
    page.fill("#steps", SMALL["steps"])

    video = submit(page)
    assert video["h3serve"]["workflow"] == "fl2va"
    assert video["h3serve"]["first_frame"] == asset_id
    assert not video["h3serve"]["last_frame"]
    wait_completed(page, video["id"])
    expect(card(page, video["id"]).locator("[data-testid=job-workflow]")).to_have_text("fl2va")
    expect(card(page, video["id"]).locator("[data-testid=job-meta]")).to_contain_text("first keyframe")
    card(page, video["id"]).locator("[data-testid=job-play]").click()
    player = card(page, video["id"]).locator("[data-testid=job-video]")
    page.wait_for_function("v => v.readyState >= 2 && v.duration > 0", arg=player.element_handle())
    player.evaluate("v => v.pause()")
    shot(page, shots, "fl2va", docs=True)

    # Edit copies the keyframe back into the form: the same asset, no new upload
    page.click("#reset-form")
    expect(chip).to_have_count(0)
    card(page, video["id"]).locator("[data-testid=job-edit]").click()
    expect(page.locator("#wf-fl2va")).to_be_checked()
    expect(chip).to_have_attribute("data-asset-id", asset_id)
    expect(page.locator("#prompt")).to_have_value("<Picture 1> slowly drifts out to sea")


def test_refused_request_shows_the_server_message(page, base, shots):
    from playwright.sync_api import expect

    body = {
        "model": "minimax-h3",
        "workflow": "t2va",
        "prompt": "a canvas the model does not take",
        "size": "100x100",
        "steps": 8,
    }
    status, answer = call(base, "POST", "/v1/videos", body)
    assert 400 <= status < 500, (status, answer)
    message = answer["error"]["message"]
    assert message

    before = page.locator("#job-list [data-testid=job]").count()
    fill_form(page, "t2va", body["prompt"], size="100x100", steps="8")
    with page.expect_response(lambda r: r.url.endswith("/v1/videos") and r.request.method == "POST") as response:
        page.click("#submit")
    assert response.value.status == status
    expect(page.locator("#form-error")).to_be_visible()
    expect(page.locator("#form-error")).to_have_text(message)
    expect(page.locator("#submit")).to_be_enabled()
    assert page.locator("#job-list [data-testid=job]").count() == before
    shot(page, shots, "error", docs=True)

    # a prompt-less submission is stopped in the page; correcting the size clears the error on the next submit
    page.fill("#prompt", "")
    page.click("#submit")
    expect(page.locator("#form-error")).to_have_text("Enter a prompt.")


def test_token_is_kept_and_sent(page, base):
    from playwright.sync_api import expect

    token = "console-test-token"
    page.fill("#token", token)
    with page.expect_request(lambda r: "/v1/videos?" in r.url) as listed:
        page.locator("#token").blur()  # "change": the list is fetched again with the token
    assert listed.value.headers.get("authorization") == f"Bearer {token}"
    page.reload()
    expect(page.locator("#token")).to_have_value(token)
    with page.expect_request(lambda r: "/v1/videos?" in r.url) as listed:
        page.click("#refresh")
    assert listed.value.headers.get("authorization") == f"Bearer {token}"
    page.fill("#token", "")
    page.locator("#token").blur()
    assert page.evaluate("localStorage.getItem('h3serve.console.token')") is None


def test_cancel_a_running_job(page, base, shots):
    from playwright.sync_api import expect

    # big enough to be caught while it denoises (tens of seconds on a 2-core CPU), cancelled at once
    fill_form(page, "t2va", "a long ride through the night, cancelled", size="256x256", steps="50")
    video = submit(page)
    job = card(page, video["id"])
    expect(job.locator(".status-detail")).to_contain_text("denoising", timeout=JOB_TIMEOUT_MS)
    expect(job).to_have_attribute("data-status", "in_progress")
    expect(job.locator("[data-testid=job-cancel]")).to_be_visible()
    expect(job.locator("[data-testid=job-play]")).to_be_hidden()
    shot(page, shots, "running", docs=True)
    job.locator("[data-testid=job-cancel]").click()
    expect(job).to_have_attribute("data-status", "cancelled", timeout=60_000)
    expect(job.locator(".status-word")).to_have_text("cancelled")
    expect(job.locator("[data-testid=job-cancel]")).to_be_hidden()
    expect(job.locator("[data-testid=job-download]")).to_be_hidden()
    assert int(job.locator("[data-testid=job-progress]").get_attribute("aria-valuenow")) < 100
    assert call(base, "GET", f"/v1/videos/{video['id']}")[1]["status"] == "cancelled"
    shot(page, shots, "cancelled")


def test_events_resume_with_last_event_id(page, base):
    """The first event stream breaks after two messages; the console reconnects with Last-Event-ID: 2 and
    follows the job on from there."""
    from playwright.sync_api import expect

    asked: list[str | None] = []

    def events(route):
        asked.append(route.request.headers.get("last-event-id"))
        if len(asked) == 1:
            job_id = route.request.url.split("/v1/videos/")[1].split("/")[0]
            route.fulfill(status=200, content_type="text/event-stream", body=first_messages(base, job_id, 2))
        else:
            route.continue_()

    page.route("**/v1/videos/*/events", events)
    fill_form(page, "t2va", "a lighthouse in a storm, followed twice", size="256x256", steps="50")
    video = submit(page)
    job = card(page, video["id"])
    expect(job.locator(".status-detail")).to_contain_text("denoising", timeout=JOB_TIMEOUT_MS)
    assert asked[:2] == [None, "2"], asked
    seen = page.evaluate("id => window.__seen[id]", video["id"])
    assert seen["progress"] == sorted(seen["progress"]), seen  # no event replayed twice, none moved it back
    job.locator("[data-testid=job-cancel]").click()
    expect(job).to_have_attribute("data-status", "cancelled", timeout=60_000)


def test_a_refused_token_says_so(page):
    """A 401 from the door (here staged by the browser: the test stack takes any token) puts up the banner."""
    from playwright.sync_api import expect

    refusal = {
        "error": {
            "message": "missing or wrong bearer token",
            "type": "authentication_error",
            "param": None,
            "code": "unauthenticated",
        }
    }
    # every API call refused, as a wrong token is: a refresh also reads v1/models, whose answer, were it a 200,
    # would take the banner down again (it did, once, when only the list was refused)
    page.route("**/v1/**", lambda route: route.fulfill(status=401, json=refusal))
    page.click("#refresh")
    expect(page.locator("#auth-banner")).to_be_visible()
    expect(page.locator("#auth-banner")).to_contain_text("missing or wrong bearer token")
    expect(page.locator("#list-error")).to_have_text("missing or wrong bearer token")
    expect(page.locator("#token")).to_have_class(re.compile("attention"))
    page.unroute("**/v1/**")
    page.click("#refresh")
    expect(page.locator("#auth-banner")).to_be_hidden()


# ---------------------------------------------------------------- issue 28: labels, seed, adapters


def keyframe_png(path: Path, tint: int) -> Path:
    from PIL import Image

    image = Image.new("RGB", (64, 32))
    image.putdata([(x * 4, y * 8, tint) for y in range(32) for x in range(64)])
    image.save(path)
    return path


@pytest.mark.timeout(600)
def test_a_failed_keyframe_upload_keeps_the_labels_the_prompt_names(page, base, tmp_path):
    """A first frame the gateway refuses does not make the last frame <Picture 1> while the prompt names it
    <Picture 2>: the failed slot keeps its place until another image takes it (in place) or it is removed."""
    from playwright.sync_api import expect

    first, last = keyframe_png(tmp_path / "first.png", 40), keyframe_png(tmp_path / "last.png", 220)
    page.check("#wf-fl2va")
    page.set_input_files(
        "#first-frame-file",
        files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"these are notes, not an image\n"}],
    )
    page.set_input_files("#last-frame-file", str(last))
    first_chip = page.locator("#first-frame-asset [data-testid=asset]")
    last_chip = page.locator("#last-frame-asset [data-testid=asset]")
    expect(first_chip).to_have_attribute("data-state", "error")
    expect(last_chip).to_have_attribute("data-state", "ready")
    page.fill("#prompt", "<Picture 1> a kite rises until <Picture 2> it is a speck")
    expect(last_chip.locator("[data-testid=asset-label]")).to_have_text("<Picture 2>")
    expect(first_chip.locator("[data-testid=asset-label]")).to_have_text("<Picture 1>")

    # another image in place of the failed one, without removing it first: the labels do not move
    expect(page.locator('label[for="first-frame-file"]')).to_be_visible()
    expect(page.locator('label[for="last-frame-file"]')).to_be_hidden()
    page.set_input_files("#first-frame-file", str(first))
    expect(first_chip).to_have_attribute("data-state", "ready")
    expect(first_chip.locator("[data-testid=asset-label]")).to_have_text("<Picture 1>")
    expect(last_chip.locator("[data-testid=asset-label]")).to_have_text("<Picture 2>")
    expect(page.locator("#form-error")).to_be_hidden()
    page.fill("#size", SMALL["size"])
    page.fill("#steps", SMALL["steps"])
    _, video = submit_sent(page)  # the gateway refuses a prompt naming a picture the request does not have
    assert video["h3serve"]["first_frame"] == first_chip.get_attribute("data-asset-id")
    assert video["h3serve"]["last_frame"] == last_chip.get_attribute("data-asset-id")
    cancel(base, video["id"])

    # removing a keyframe does renumber: a request with the last frame alone names it <Picture 1>
    first_chip.locator("[data-testid=asset-remove]").click()
    expect(first_chip).to_have_count(0)
    expect(last_chip.locator("[data-testid=asset-label]")).to_have_text("<Picture 1>")


@pytest.mark.timeout(600)
def test_a_seed_does_not_carry_over_unless_typed(page, base):
    """Re-run and Edit bring back a job's seed on purpose, for the next submission only; after it the form is fresh
    (Generate draws a new seed). A seed the user typed stays until changed."""
    from playwright.sync_api import expect

    seed_field = page.locator("#seed")
    fill_form(page, "t2va", "a paper boat on a pond, twice", **SMALL)
    first = submit(page)
    seed = str(first["h3serve"]["seed"])
    expect(seed_field).to_have_value("")

    with page.expect_response(lambda r: r.url.endswith("/v1/videos") and r.request.method == "POST") as answer:
        card(page, first["id"]).locator("[data-testid=job-rerun]").click()
    rerun = answer.value.json()
    assert str(rerun["h3serve"]["seed"]) == seed  # a re-run is the same job again
    expect(page.locator("#prompt")).to_have_value("a paper boat on a pond, twice")
    expect(seed_field).to_have_value("")  # but "generate again" is not
    sent, again = submit_sent(page)
    assert "seed" not in sent, sent
    assert str(again["h3serve"]["seed"]) != seed

    card(page, first["id"]).locator("[data-testid=job-edit]").click()
    expect(seed_field).to_have_value(seed)  # restored on purpose
    sent, edited = submit_sent(page)
    assert str(sent["seed"]) == seed and str(edited["h3serve"]["seed"]) == seed
    expect(seed_field).to_have_value("")

    page.fill("#seed", "4242")
    typed = submit(page)
    assert typed["h3serve"]["seed"] == 4242
    expect(seed_field).to_have_value("4242")  # typed: kept
    typed_again = submit(page)
    assert typed_again["h3serve"]["seed"] == 4242
    page.click("#reset-form")
    expect(seed_field).to_have_value("")
    cancel(base, *(job["id"] for job in (first, rerun, again, edited, typed, typed_again)))


def test_the_adapter_picker_without_adapters(page, base):
    """The stack's DiT loads no adapters: the door lists none (GET /v1/models), the picker says "none served", and
    the request names none."""
    from playwright.sync_api import expect

    with page.expect_response(lambda r: r.url.endswith("/v1/models")) as listed:
        page.reload()
    assert listed.value.status == 200 and listed.value.json()["data"][0]["h3serve"]["adapters"] == []
    expect(page.locator("#adapters")).to_be_visible()
    expect(page.locator("#adapters-none")).to_have_text("none served")
    expect(page.locator("#adapter-list [data-testid=adapter]")).to_have_count(0)
    fill_form(page, "t2va", "a quiet street, no adapters", **SMALL)
    sent, video = submit_sent(page)
    assert "adapters" not in sent
    assert video["h3serve"]["adapters"] == []
    cancel(base, video["id"])


def unknown_listing(route) -> None:
    """The door's answer while no DiT replica has said which adapters it loaded (still loading): adapters null."""
    served = {"adapter_mode": "unfused", "adapters": None, "max_request_adapters": 0}
    route.fulfill(json={"object": "list", "data": [{"id": "minimax-h3", "object": "model", "h3serve": served}]})


@pytest.mark.timeout(900)
def test_the_adapter_picker_sends_the_ticked_adapters_and_a_restore_ticks_them_again(browser, adapter_stack, shots):
    from playwright.sync_api import expect

    base = adapter_stack.http.rstrip("/")
    with console(browser, base) as page:
        rows = page.locator("#adapter-list [data-testid=adapter]")
        expect(page.locator("#adapters")).to_be_visible()
        expect(rows).to_have_count(3)
        expect(page.locator("#adapters-none")).to_be_hidden()
        assert [row.get_attribute("data-name") for row in rows.all()] == ["refstyle", "style", "turbo"]

        def row(name: str, part: str):
            return page.locator(f'#adapter-list [data-name="{name}"] [data-testid=adapter-{part}]')

        expect(row("turbo", "info")).to_have_text("scale 2 · recommends 3 steps")
        expect(row("style", "info")).to_have_text("scale 0.5")
        for name in ("turbo", "style", "refstyle"):
            expect(row(name, "weight")).to_have_value("1")  # the default weight: the adapter's own scale
        expect(row("refstyle", "on")).to_be_disabled()  # t2va runs on transformer, refstyle on transformer_ref
        expect(row("refstyle", "info")).to_contain_text("not for t2va")

        # ticked turbo (at 0.125) then style: sent in that order; steps left unset take turbo's recommendation
        fill_form(page, "t2va", "a kite over the dunes, turbo then style", size=SMALL["size"])
        row("turbo", "on").check()
        row("turbo", "weight").fill("0")  # 0 would mean 1.0 to the gateway: the form says so instead
        page.click("#submit")
        expect(page.locator("#form-error")).to_contain_text("A weight of 0 means 1 to the gateway")
        row("turbo", "weight").fill("0.125")
        row("style", "on").check()
        expect(row("turbo", "order")).to_have_text("1")
        expect(row("style", "order")).to_have_text("2")
        shot(page, shots, "adapters")
        sent, video = submit_sent(page)
        assert sent["adapters"] == [{"name": "turbo", "weight": 0.125}, {"name": "style", "weight": 1}], sent
        assert video["h3serve"]["adapters"] == [{"name": "turbo", "weight": 0.125}, {"name": "style", "weight": 1.0}]
        assert video["h3serve"]["steps"] == 3
        wait_completed(page, video["id"])  # the DiT ran them
        expect(card(page, video["id"]).locator("[data-testid=job-meta]")).to_contain_text("turbo ×0.125 + style ×1")

        # Clear unticks them; Edit ticks the job's adapters again, with its weights and in its order
        page.click("#reset-form")
        for name in ("turbo", "style"):
            expect(row(name, "on")).not_to_be_checked()
        expect(row("turbo", "weight")).to_have_value("1")
        card(page, video["id"]).locator("[data-testid=job-edit]").click()
        expect(row("turbo", "on")).to_be_checked()
        expect(row("style", "on")).to_be_checked()
        expect(row("refstyle", "on")).not_to_be_checked()
        expect(row("turbo", "weight")).to_have_value("0.125")  # exactly
        expect(row("turbo", "order")).to_have_text("1")
        sent, again = submit_sent(page)
        assert sent["adapters"] == [{"name": "turbo", "weight": 0.125}, {"name": "style", "weight": 1}], sent
        assert again["h3serve"]["adapters"] == video["h3serve"]["adapters"]
        cancel(base, again["id"])

        # ref2va: only refstyle can run there; the ticked transformer adapters stay ticked, greyed, not sent
        page.check("#wf-ref2va")
        expect(row("refstyle", "on")).to_be_enabled()
        expect(row("turbo", "on")).to_be_disabled()
        expect(row("turbo", "on")).to_be_checked()
        expect(row("turbo", "info")).to_contain_text("not for ref2va")
        page.check("#wf-t2va")

        # a door that cannot list them (its DiT still loading): a restored job's adapters show (and go), unlisted
        page.route("**/v1/models", unknown_listing)
        card(page, video["id"]).locator("[data-testid=job-edit]").click()
        with page.expect_response(lambda r: r.url.endswith("/v1/models")):
            page.click("#refresh")
        expect(rows).to_have_count(2)
        expect(row("turbo", "info")).to_have_text("from the restored job; not listed by this gateway")
        expect(row("turbo", "on")).to_be_checked()
        page.click("#reset-form")
        expect(page.locator("#adapters")).to_be_hidden()
