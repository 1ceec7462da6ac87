"""The Python SDK: submit jobs to a dit-serve service, watch them with a progress bar, get PIL images.

    from dit_serve.client import Client

    with Client("http://127.0.0.1:8000") as c:
        job = c.submit(labels=[3, 7], num_per_label=4)
        job = c.wait(job)                    # a tqdm bar over the job's denoising steps
        images = c.images(job)               # PIL images, in item order
        edit = c.submit(labels=[8], image="three.png", mask="left.png", strength=1.0)  # inpainting
        both = c.submit(prompts=["the cat of image 1 on the sofa of image 2"], model="Qwen-Image-Edit-2509",
                        image=["cat.png", "sofa.png"])  # an instruction edit with several reference images

``wait`` follows the job's Server-Sent Events (``events``, ``GET /v1/jobs/{id}/events``): it returns as
soon as the job ends and shows progress as it comes; a dropped stream resumes with ``Last-Event-ID``,
and a service without the stream (older), a refused one (429) or one that keeps dropping is polled.

``AsyncClient`` has the same methods as coroutines. Imports httpx, pydantic, tqdm and (for images)
pillow; never torch or ray, so a laptop can submit to a remote cluster. Service errors raise
``ApiError`` with the server's message.

``url`` defaults to the ``DIT_SERVE_URL`` environment variable, else http://127.0.0.1:8000; ``api_key``
(default: the ``DIT_SERVE_API_KEY`` environment variable) is sent as a bearer token. A request that
cannot be sent as JSON (a NaN or infinite number) raises ``InvalidRequest``, naming the field, before
anything is sent.
Requests that are safe to repeat are retried on connection errors and 502/503/504 answers, with
backoff, and on 429 (the service's queue is full) after the ``Retry-After`` it sends (at most
``max_retry_after`` seconds); ``submit`` is one of them, because it sends an ``Idempotency-Key`` (a fresh
one per call unless given), so a retried submission can never queue the same job twice.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import httpx
from pydantic import TypeAdapter

from dit_serve.schemas import (UPLOAD_ID, EndEvent, Job, JobEvent, JobList, Lora, LoraList, ModelList, PreviewEvent,
                               ProgressEvent, Upload)

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "DIT_SERVE_URL"
API_KEY_ENV = "DIT_SERVE_API_KEY"
JobRef = Job | str
PreviewFn = Callable[[int, int, Any], None]  # (item index, step, PIL image)
RETRY_STATUS = {502, 503, 504}  # a proxy or a restarting service: worth another try
STREAM_SILENCE_S = 35.0  # an event stream silent this long has dropped (the service sends a keep-alive every 15 s)
# an edit's image or mask up to this size goes inline in the job (base64; the service takes 4 MiB by default);
# a larger one is uploaded first (POST /v1/uploads) and named by its id
INLINE_MAX_BYTES = 2 << 20
_EVENTS = TypeAdapter(JobEvent)


class ApiError(Exception):
    """An error answer from the service: ``status`` (HTTP), ``message`` and the offending ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 retry_after: str | None = None):
        super().__init__(f"{message} (HTTP {status})")
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.retry_after = retry_after  # the Retry-After header of a 429 or 503, if any


class InvalidRequest(ValueError):
    """A request the SDK refuses to send; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def _base_url(url: str | None) -> str:
    return (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")


def _check(r: httpx.Response) -> httpx.Response:
    if r.is_success:
        return r
    try:
        err = r.json()["error"]
        raise ApiError(r.status_code, err["message"], err.get("param"), err.get("type"), r.headers.get("Retry-After"))
    except (ValueError, KeyError, TypeError):
        raise ApiError(r.status_code, r.text[:200] or r.reason_phrase) from None


def _auth(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _repeatable(method: str, headers: dict) -> bool:
    return method in ("GET", "DELETE") or "Idempotency-Key" in headers


def _backoff(attempt: int) -> float:
    return min(0.25 * 2 ** attempt, 4.0)


def _retry_in(r: httpx.Response | None, attempt: int, cap: float) -> float | None:
    """Seconds to wait before another try of a repeatable request, or None: answer it as it is."""
    if r is None:
        return _backoff(attempt)
    if r.status_code == 429:
        try:
            wait = float(r.headers["Retry-After"])
        except (KeyError, ValueError):
            return None
        return wait if 0 <= wait <= cap else None
    return _backoff(attempt) if r.status_code in RETRY_STATUS else None


def _job_id(job: JobRef) -> str:
    return job.id if isinstance(job, Job) else job


def _job_body(labels, **fields) -> dict[str, Any]:
    body = dict(labels=None if labels is None else list(labels), **fields)
    if body.get("prompts") is not None:
        body["prompts"] = list(body["prompts"])
    for name, value in body.items():  # JSON has no NaN or infinity: httpx would fail deep inside
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number, got {value}", name)
    return {k: v for k, v in body.items() if v is not None}


def _loras(loras) -> list[dict] | None:
    """``submit``'s ``loras`` as the API takes them: ("name", scale) pairs, {"name", "scale"} maps, or names."""
    if loras is None:
        return None
    out = []
    for entry in loras:
        if isinstance(entry, str):
            out.append({"name": entry})
        elif isinstance(entry, dict):
            out.append(dict(entry))
        elif isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str):
            out.append({"name": entry[0], "scale": entry[1]})
        else:
            raise InvalidRequest(f"an adapter is a name, a (name, scale) pair or a {{'name', 'scale'}} map, not "
                                 f"{repr(entry)[:60]}", "loras")
        scale = out[-1].get("scale")
        if isinstance(scale, float) and not math.isfinite(scale):
            raise InvalidRequest(f"adapter {out[-1].get('name')!r}: scale must be a finite number", "loras")
    return out


def _lora_file(path: str | Path) -> tuple[str, bytes]:
    path = Path(path)
    try:
        return path.name, path.read_bytes()
    except OSError as e:
        raise InvalidRequest(f"cannot read {path}: {e.strerror or e}", "file") from None


def _lora_form(name: str, model: str | None, shared: bool | None) -> dict:
    form = {"name": name, "model": model, "shared": None if shared is None else str(bool(shared)).lower()}
    return {k: (None, v) for k, v in form.items() if v is not None}


def _image_source(value: Any, field: str) -> tuple[str | None, bytes | None, str]:
    """What ``submit``'s ``image`` or ``mask`` sends: (an upload's id or a data URL as it is, None, "") or (None,
    the file's bytes, a file name). A path (str or Path) is read; bytes are an encoded PNG, JPEG or WebP file; a
    PIL image is sent as PNG; a string 'upl_...' that is no file names an earlier upload (``upload``)."""
    if isinstance(value, str) and (value.startswith("data:") or
                                   (re.match(UPLOAD_ID, value) and not os.path.exists(value))):
        return value, None, ""
    if isinstance(value, (str, Path)):
        try:
            return None, Path(value).read_bytes(), Path(value).name
        except OSError as e:
            raise InvalidRequest(f"{field}: cannot read {str(value)!r}: {e.strerror or e}", field) from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return None, bytes(value), f"{field}.bin"
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return None, buf.getvalue(), f"{field}.png"
    raise InvalidRequest(f"{field} must be a file path, the bytes of a PNG, JPEG or WebP file, a PIL image or an "
                         f"upload's id, not {type(value).__name__}", field)


def _edit_fields(sources: dict[str, tuple[str | None, bytes | None, str]], uploaded: dict[str, str]) -> dict:
    """The job body's image and mask fields: an id or data URL as given, an uploaded file's id, else base64; a list
    of images (sources ``image[i]``) as one list in ``image``, each inline one as a data URL."""
    out, listed = {}, []
    for field, (given, data, _) in sources.items():
        value = given if given is not None else uploaded.get(field)
        if field.startswith("image["):
            listed.append(value or f"data:application/octet-stream;base64,{base64.b64encode(data).decode('ascii')}")
        elif value is not None:
            out[field] = value
        elif data is not None:
            out[f"{field}_b64"] = base64.b64encode(data).decode("ascii")
    if listed:
        out["image"] = listed
    return out


def _to_upload(sources: dict, inline_max: int) -> dict[str, tuple[bytes, str]]:
    """The files too large to send inline (over ``inline_max`` bytes): uploaded first (POST /v1/uploads)."""
    return {f: (data, name) for f, (_, data, name) in sources.items() if data is not None and len(data) > inline_max}


def _sources(image: Any, mask: Any) -> dict:
    """What ``submit`` sends of ``image`` (one, or a list: a model's reference images, each named ``image[i]``) and
    ``mask``."""
    images = [("image", image)] if not isinstance(image, (list, tuple)) else \
        [(f"image[{i}]", v) for i, v in enumerate(image)]
    return {f: _image_source(v, f) for f, v in (*images, ("mask", mask)) if v is not None}


def _pil(png: bytes):
    from PIL import Image

    img = Image.open(io.BytesIO(png))
    img.load()
    return img


class _Bar:
    """A tqdm bar over a job's denoising steps (all items together), fed by polls or by events."""

    def __init__(self, job: JobRef, enabled: bool):
        from tqdm.auto import tqdm

        class Bar(tqdm):
            # no monitor thread: a second thread can take a Ctrl-C's SIGINT while the main thread waits in a
            # socket read for the job's next event, which then goes on waiting instead of being interrupted
            monitor_interval = 0

        known = isinstance(job, Job)
        self.state = job.state if known else "queued"  # the last state seen (for a timeout's message)
        self.final: Job | None = None  # the ended job, when its end event carried it
        self.bar = Bar(total=job.steps_total if known else 0, desc=f"job {_job_id(job)[:8]}", unit="step",
                        disable=not enabled)

    def update(self, job: Job | JobEvent) -> None:
        if isinstance(job, EndEvent) and job.job is not None:
            self.final = job.job
        if not isinstance(job, (Job, ProgressEvent, EndEvent)) or job.state == "deleted":  # items: no steps
            return
        self.state, self.bar.total, self.bar.n = job.state, job.steps_total, job.steps_done
        self.bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in sorted(job.counts.items())), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _SSE:
    """Server-Sent Events parsing (WHATWG's rules, those this service's streams use): lines in, events
    out. ``last_id`` is the id to resume from (``Last-Event-ID``)."""

    def __init__(self, last_id: str | None = None):
        self.last_id = self._id = last_id
        self._name, self._data = "", []

    def feed(self, line: str) -> JobEvent | None:
        """The event a blank line completes; None for other lines, comments and unknown events. An id
        counts once its event is complete: a stream cut inside an event resumes before that event."""
        if not line:
            name, data, self.last_id = self._name, "\n".join(self._data), self._id
            self._name, self._data = "", []
            if not data or name not in ("progress", "item", "preview", "end"):
                return None
            try:
                return _EVENTS.validate_json(data)
            except ValueError:  # from a newer service, say, with a state this SDK does not know: skipped
                return None
        if line.startswith(":"):  # a comment: the keep-alive
            return None
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self._name = value
        elif field == "data":
            self._data.append(value)
        elif field == "id" and "\0" not in value:
            self._id = value
        return None


def _stream_request(job: JobRef, sse: _SSE, auth: dict, timeout: httpx.Timeout, deadline: float | None) -> dict:
    """httpx.stream arguments of one (re)connection: Last-Event-ID, and a read timeout that ends at the
    deadline or when the stream has been silent too long."""
    headers = {**auth, "Accept": "text/event-stream"}
    if sse.last_id:
        headers["Last-Event-ID"] = sse.last_id
    read = STREAM_SILENCE_S if deadline is None else min(STREAM_SILENCE_S, max(0.05, deadline - time.monotonic()))
    return dict(method="GET", url=f"/v1/jobs/{_job_id(job)}/events", headers=headers,
                timeout=httpx.Timeout(timeout.connect, read=read, write=timeout.write, pool=timeout.pool))


def _opened(r: httpx.Response) -> None:
    """Raise ApiError unless ``r`` (read, when an error) is an event stream."""
    _check(r)
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        raise ApiError(r.status_code, f"not an event stream: {r.headers.get('content-type')}")


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


class Client:
    """A blocking client. ``url`` is the service's base URL."""

    def __init__(self, url: str | None = None, timeout: float = 60.0, http: httpx.Client | None = None, *,
                 api_key: str | None = None, retries: int = 3, max_retry_after: float = 60.0):
        self.url = _base_url(url)
        self._http = http or httpx.Client(base_url=self.url, timeout=timeout)
        self._auth, self.retries, self.max_retry_after = _auth(api_key), retries, max_retry_after

    def _call(self, method: str, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
        headers = {**self._auth, **(headers or {})}
        attempts = self.retries + 1 if _repeatable(method, headers) else 1
        for attempt in range(attempts):
            r = None
            try:
                r = self._http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError:
                if attempt == attempts - 1:
                    raise
            wait = _retry_in(r, attempt, self.max_retry_after)
            if r is not None and (wait is None or attempt == attempts - 1):
                return _check(r)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def submit(self, labels: list[int | str] | None = None, *, prompts: list[str] | None = None,
               negative_prompt: str | None = None, num_per_prompt: int | None = None, model: str | None = None,
               num_per_label: int | None = None, seed: int | None = None,
               seeds: list[int] | None = None, sampler: str | None = None, steps: int | None = None,
               guidance: float | None = None, eta: float | None = None, priority: int | None = None,
               webhook_url: str | None = None, idempotency_key: str | None = None, width: int | None = None,
               height: int | None = None, exact_size: bool | None = None, preview_every: int | None = None,
               image: Any = None, mask: Any = None, strength: float | None = None, loras: Any = None) -> Job:
        """Queue a job: each label ``num_per_label`` times (class models), or each prompt ``num_per_prompt``
        times (text models, with an optional ``negative_prompt``); returns once the service stored it. Jobs of a
        higher ``priority`` (-100..100, default 0) run first. ``webhook_url`` is POSTed the finished job.
        ``width`` x ``height``: a size the model makes, or (models with aspect-ratio bins) any size, made at
        the nearest bin and, with ``exact_size``, resized to it. ``preview_every`` N: a preview of each
        running image every N steps (``wait(on_preview=...)``). Item i uses ``seeds[i]``, else ``seed + i``;
        without either the service draws a random seed (recorded in the job).
        Edits (models whose card says ``takes_image``): ``image`` (a file path, bytes of a PNG, JPEG or WebP
        file, a PIL image, or an upload's id) is varied at ``strength`` in (0, 1]; with ``mask`` (the same kinds;
        white = repaint) it is inpainted. An instruction edit's model may take several reference images: ``image``
        a list of them, in order (at most its card's ``max_images``: Qwen-Image-Edit-Plus 3). Files up to
        ``INLINE_MAX_BYTES`` go inline, larger ones are uploaded.
        ``loras``: adapters applied to every image, as ("name", scale) pairs or {"name": ..., "scale": ...} maps
        (``loras()`` lists those you may name). The same ``idempotency_key`` (default: a fresh one) on a later call
        returns this job rather than a new one."""
        body = _job_body(labels, prompts=prompts, negative_prompt=negative_prompt, num_per_prompt=num_per_prompt,
                         model=model, num_per_label=num_per_label, seed=seed, seeds=seeds, sampler=sampler,
                         steps=steps, guidance=guidance, eta=eta, priority=priority, webhook_url=webhook_url,
                         width=width, height=height, exact_size=exact_size, preview_every=preview_every,
                         strength=strength, loras=_loras(loras))
        sources = _sources(image, mask)
        uploaded = {f: self.upload(data, name).id for f, (data, name) in _to_upload(sources, INLINE_MAX_BYTES).items()}
        body.update(_edit_fields(sources, uploaded))
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        return Job.model_validate(self._call("POST", "/v1/jobs", json=body, headers=headers).json())

    def upload(self, image: Any, filename: str | None = None) -> Upload:
        """Upload an image for edits (a path, bytes or a PIL image, as ``submit`` takes); its ``id`` is what
        ``submit(image=...)`` or ``mask=`` may name. Uploads count in the tenant's quota until retention deletes
        them (``delete_upload`` sooner)."""
        _, data, name = _image_source(image, "image")
        if data is None:
            raise InvalidRequest("upload takes a file, not an upload's id or a data URL", "image")
        r = self._call("POST", "/v1/uploads", files={"file": (filename or name, data)})
        return Upload.model_validate(r.json())

    def delete_upload(self, upload_id: str) -> Upload:
        return Upload.model_validate(self._call("DELETE", f"/v1/uploads/{upload_id}").json())

    def loras(self) -> LoraList:
        """The adapters (LoRA) your jobs may name: your own and the shared ones."""
        return LoraList.model_validate(self._call("GET", "/v1/loras").json())

    def upload_lora(self, path: str | Path, name: str, model: str | None = None, shared: bool | None = None) -> Lora:
        """Register a safetensors adapter file as ``name`` for ``model`` (the service's first when None); the
        service checks it first (format, size, rank, family). ``shared`` (admin key): every tenant may use it."""
        filename, data = _lora_file(path)
        files = {"file": (filename, data), **_lora_form(name, model, shared)}
        return Lora.model_validate(self._call("POST", "/v1/loras", files=files).json())

    def delete_lora(self, name: str) -> Lora:
        return Lora.model_validate(self._call("DELETE", f"/v1/loras/{name}").json())

    def get(self, job: JobRef, items: bool = True) -> Job:
        return Job.model_validate(self._call("GET", f"/v1/jobs/{_job_id(job)}", params={"items": items}).json())

    def list(self, limit: int = 20, offset: int = 0) -> JobList:
        return JobList.model_validate(self._call("GET", "/v1/jobs", params={"limit": limit, "offset": offset}).json())

    def cancel(self, job: JobRef) -> Job:
        """Cancel: queued items never run, running ones stop at their next step; finished images stay."""
        return Job.model_validate(self._call("DELETE", f"/v1/jobs/{_job_id(job)}").json())

    def delete(self, job: JobRef) -> Job:
        """Cancel and delete the job with its images; returns the job as it was."""
        return Job.model_validate(self._call("DELETE", f"/v1/jobs/{_job_id(job)}", params={"purge": True}).json())

    def models(self) -> ModelList:
        return ModelList.model_validate(self._call("GET", "/v1/models").json())

    def wait(self, job: JobRef, progress: bool = True, timeout: float | None = None, interval: float = 0.25,
             on_preview: PreviewFn | None = None) -> Job:
        """Until the job is done, failed or cancelled; returns it, with its items (TimeoutError after
        ``timeout`` seconds). Follows the job's events, so it returns as soon as the job ends; without
        them (an older service, a refused or failing stream) it polls every ``interval`` seconds.
        ``on_preview(index, step, image)`` is called with each preview (a PIL image) of a job submitted
        with ``preview_every``, as its events arrive (none while polling)."""
        deadline, bar = _deadline(timeout), _Bar(job, progress)
        try:
            if not self._follow(job, bar, deadline, on_preview):
                self._poll(job, bar, deadline, interval)
        except TimeoutError:
            raise TimeoutError(f"job {_job_id(job)} still {bar.state} after {timeout} s") from None
        finally:
            bar.close()
        return bar.final or self.get(job)

    def _follow(self, job: JobRef, bar: _Bar, deadline: float | None, on_preview: PreviewFn | None = None) -> bool:
        """Show the job's events on ``bar`` until its end: True; False when there is no stream to follow."""
        try:
            with contextlib.closing(self.events(job, timeout=_left(deadline))) as events:
                for event in events:
                    bar.update(event)
                    if on_preview is not None and isinstance(event, PreviewEvent):
                        self._preview(event, on_preview)
            return True
        except (ApiError, httpx.TransportError):
            return False

    def _preview(self, event: PreviewEvent, on_preview: PreviewFn) -> None:
        try:
            png = self._call("GET", event.url).content
        except ApiError as e:  # 404: the item ended meanwhile (its image follows)
            if e.status != 404:
                raise
            return
        on_preview(event.index, event.step, _pil(png))

    def _poll(self, job: JobRef, bar: _Bar, deadline: float | None, interval: float) -> None:
        current = self.get(job, items=False)
        bar.update(current)
        while not current.finished:
            if _past(deadline):
                raise TimeoutError
            time.sleep(interval)
            current = self.get(current.id, items=False)
            bar.update(current)

    def events(self, job: JobRef, last_event_id: str | None = None, timeout: float | None = None
               ) -> Iterator[JobEvent]:
        """The job's events as they happen: ``ProgressEvent``, ``ItemEvent`` (once per item ending) and a
        last ``EndEvent``. A dropped stream is resumed with ``Last-Event-ID`` (up to ``retries`` times in a
        row), which neither repeats nor skips item events. ``ApiError`` for an error answer (a 404 also from
        a service older than the events route); TimeoutError after ``timeout`` seconds."""
        sse, deadline, failures = _SSE(last_event_id), _deadline(timeout), 0
        while True:
            try:
                with self._http.stream(**_stream_request(job, sse, self._auth, self._http.timeout, deadline)) as r:
                    if not r.is_success:
                        r.read()
                    _opened(r)
                    for line in r.iter_lines():
                        if (event := sse.feed(line)) is not None:
                            failures = 0
                            yield event
                            if isinstance(event, EndEvent):
                                return
                        if _past(deadline):
                            raise TimeoutError(f"job {_job_id(job)} did not end within {timeout} s")
            except httpx.TransportError:  # dropped, refused, or silent past its read timeout
                if _past(deadline):
                    raise TimeoutError(f"job {_job_id(job)} did not end within {timeout} s") from None
                if failures >= self.retries:
                    raise
            else:  # closed before its end event
                if failures >= self.retries:
                    raise httpx.RemoteProtocolError(f"the event stream of job {_job_id(job)} keeps closing early")
            failures += 1
            time.sleep(_backoff(failures - 1))

    def image_bytes(self, job: JobRef, index: int) -> bytes:
        return self._call("GET", f"/v1/jobs/{_job_id(job)}/images/{index}").content

    def image(self, job: JobRef, index: int):
        return _pil(self.image_bytes(job, index))

    def images(self, job: JobRef) -> list:
        """The finished items' images as PIL images, in item order."""
        full = self.get(job)
        return [self.image(full.id, it.index) for it in full.items if it.state == "done"]

    def archive(self, job: JobRef, path: str | Path) -> Path:
        """Download the zip of the job's images and manifest to ``path``."""
        path = Path(path)
        with self._http.stream("GET", f"/v1/jobs/{_job_id(job)}/archive", headers=self._auth) as r:
            if not r.is_success:
                r.read()
                _check(r)
            with path.open("wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)
        return path

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """``Client`` with coroutines (a copy of its methods over ``httpx.AsyncClient``)."""

    def __init__(self, url: str | None = None, timeout: float = 60.0, http: httpx.AsyncClient | None = None, *,
                 api_key: str | None = None, retries: int = 3, max_retry_after: float = 60.0):
        self.url = _base_url(url)
        self._http = http or httpx.AsyncClient(base_url=self.url, timeout=timeout)
        self._auth, self.retries, self.max_retry_after = _auth(api_key), retries, max_retry_after

    async def _call(self, method: str, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
        headers = {**self._auth, **(headers or {})}
        attempts = self.retries + 1 if _repeatable(method, headers) else 1
        for attempt in range(attempts):
            r = None
            try:
                r = await self._http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError:
                if attempt == attempts - 1:
                    raise
            wait = _retry_in(r, attempt, self.max_retry_after)
            if r is not None and (wait is None or attempt == attempts - 1):
                return _check(r)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def submit(self, labels: list[int | str] | None = None, *, prompts: list[str] | None = None,
               negative_prompt: str | None = None, num_per_prompt: int | None = None, model: str | None = None,
               num_per_label: int | None = None, seed: int | None = None,
                     seeds: list[int] | None = None, sampler: str | None = None, steps: int | None = None,
                     guidance: float | None = None, eta: float | None = None, priority: int | None = None,
                     webhook_url: str | None = None, idempotency_key: str | None = None, width: int | None = None,
               height: int | None = None, exact_size: bool | None = None, preview_every: int | None = None,
                     image: Any = None, mask: Any = None, strength: float | None = None, loras: Any = None) -> Job:
        body = _job_body(labels, prompts=prompts, negative_prompt=negative_prompt, num_per_prompt=num_per_prompt,
                         model=model, num_per_label=num_per_label, seed=seed, seeds=seeds, sampler=sampler,
                         steps=steps, guidance=guidance, eta=eta, priority=priority, webhook_url=webhook_url,
                         width=width, height=height, exact_size=exact_size, preview_every=preview_every,
                         strength=strength, loras=_loras(loras))
        sources = _sources(image, mask)
        uploaded = {f: (await self.upload(data, name)).id
                    for f, (data, name) in _to_upload(sources, INLINE_MAX_BYTES).items()}
        body.update(_edit_fields(sources, uploaded))
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        return Job.model_validate((await self._call("POST", "/v1/jobs", json=body, headers=headers)).json())

    async def upload(self, image: Any, filename: str | None = None) -> Upload:
        _, data, name = _image_source(image, "image")
        if data is None:
            raise InvalidRequest("upload takes a file, not an upload's id or a data URL", "image")
        r = await self._call("POST", "/v1/uploads", files={"file": (filename or name, data)})
        return Upload.model_validate(r.json())

    async def delete_upload(self, upload_id: str) -> Upload:
        return Upload.model_validate((await self._call("DELETE", f"/v1/uploads/{upload_id}")).json())

    async def loras(self) -> LoraList:
        return LoraList.model_validate((await self._call("GET", "/v1/loras")).json())

    async def upload_lora(self, path: str | Path, name: str, model: str | None = None,
                          shared: bool | None = None) -> Lora:
        filename, data = _lora_file(path)
        files = {"file": (filename, data), **_lora_form(name, model, shared)}
        return Lora.model_validate((await self._call("POST", "/v1/loras", files=files)).json())

    async def delete_lora(self, name: str) -> Lora:
        return Lora.model_validate((await self._call("DELETE", f"/v1/loras/{name}")).json())

    async def get(self, job: JobRef, items: bool = True) -> Job:
        r = await self._call("GET", f"/v1/jobs/{_job_id(job)}", params={"items": items})
        return Job.model_validate(r.json())

    async def list(self, limit: int = 20, offset: int = 0) -> JobList:
        r = await self._call("GET", "/v1/jobs", params={"limit": limit, "offset": offset})
        return JobList.model_validate(r.json())

    async def cancel(self, job: JobRef) -> Job:
        return Job.model_validate((await self._call("DELETE", f"/v1/jobs/{_job_id(job)}")).json())

    async def delete(self, job: JobRef) -> Job:
        r = await self._call("DELETE", f"/v1/jobs/{_job_id(job)}", params={"purge": True})
        return Job.model_validate(r.json())

    async def models(self) -> ModelList:
        return ModelList.model_validate((await self._call("GET", "/v1/models")).json())

    async def wait(self, job: JobRef, progress: bool = True, timeout: float | None = None,
                   interval: float = 0.25, on_preview: PreviewFn | None = None) -> Job:
        """As ``Client.wait``: follows the job's events, else polls. ``on_preview`` is a plain function."""
        deadline, bar = _deadline(timeout), _Bar(job, progress)
        try:
            if not await self._follow(job, bar, deadline, on_preview):
                await self._poll(job, bar, deadline, interval)
        except TimeoutError:
            raise TimeoutError(f"job {_job_id(job)} still {bar.state} after {timeout} s") from None
        finally:
            bar.close()
        return bar.final or await self.get(job)

    async def _follow(self, job: JobRef, bar: _Bar, deadline: float | None,
                      on_preview: PreviewFn | None = None) -> bool:
        try:
            async with contextlib.aclosing(self.events(job, timeout=_left(deadline))) as events:
                async for event in events:
                    bar.update(event)
                    if on_preview is not None and isinstance(event, PreviewEvent):
                        await self._preview(event, on_preview)
            return True
        except (ApiError, httpx.TransportError):
            return False

    async def _preview(self, event: PreviewEvent, on_preview: PreviewFn) -> None:
        try:
            png = (await self._call("GET", event.url)).content
        except ApiError as e:  # 404: the item ended meanwhile (its image follows)
            if e.status != 404:
                raise
            return
        on_preview(event.index, event.step, _pil(png))

    async def _poll(self, job: JobRef, bar: _Bar, deadline: float | None, interval: float) -> None:
        current = await self.get(job, items=False)
        bar.update(current)
        while not current.finished:
            if _past(deadline):
                raise TimeoutError
            await asyncio.sleep(interval)
            current = await self.get(current.id, items=False)
            bar.update(current)

    async def events(self, job: JobRef, last_event_id: str | None = None, timeout: float | None = None
                     ) -> AsyncIterator[JobEvent]:
        """As ``Client.events``, an async iterator."""
        sse, deadline, failures = _SSE(last_event_id), _deadline(timeout), 0
        while True:
            try:
                async with self._http.stream(**_stream_request(job, sse, self._auth, self._http.timeout,
                                                               deadline)) as r:
                    if not r.is_success:
                        await r.aread()
                    _opened(r)
                    async for line in r.aiter_lines():
                        if (event := sse.feed(line)) is not None:
                            failures = 0
                            yield event
                            if isinstance(event, EndEvent):
                                return
                        if _past(deadline):
                            raise TimeoutError(f"job {_job_id(job)} did not end within {timeout} s")
            except httpx.TransportError:
                if _past(deadline):
                    raise TimeoutError(f"job {_job_id(job)} did not end within {timeout} s") from None
                if failures >= self.retries:
                    raise
            else:
                if failures >= self.retries:
                    raise httpx.RemoteProtocolError(f"the event stream of job {_job_id(job)} keeps closing early")
            failures += 1
            await asyncio.sleep(_backoff(failures - 1))

    async def image_bytes(self, job: JobRef, index: int) -> bytes:
        return (await self._call("GET", f"/v1/jobs/{_job_id(job)}/images/{index}")).content

    async def image(self, job: JobRef, index: int):
        return _pil(await self.image_bytes(job, index))

    async def images(self, job: JobRef) -> list:
        full = await self.get(job)
        pngs = await asyncio.gather(*[self.image_bytes(full.id, it.index) for it in full.items if it.state == "done"])
        return [_pil(p) for p in pngs]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


@contextlib.contextmanager
def service_url(url: str | None) -> Iterator[str]:
    """Yield ``url`` when one is given; else start a throwaway local service for the block (this needs
    the server side: Ray, torch) and yield its address. For scripts that work either way."""
    if url:
        yield url
        return
    from dit_serve.server.service import local_service  # server side, imported only when asked for

    with local_service() as svc:
        yield svc.url
