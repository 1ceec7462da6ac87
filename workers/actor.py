"""The worker: one Ray actor per GPU (or one CPU worker), thin around the batch engine.

``__init__`` loads the configured models, builds an ``Engine`` and warms its graphs once; then a
background thread runs the step loop. The actor's methods only pass messages to that thread and
never touch the engine, so the engine stays single-threaded:

- ``submit(items)`` / ``cancel(ids)`` queue work; the loop admits or drops it at the next step
  boundary (a cancelled item stops before its next step). Each returns a list as long as its input.
- ``load(specs)`` / ``unload(names)`` change the models it serves (autoscaling moves an idle worker to a model
  with backlog): a model to load is loaded by the loader thread and added to the engine between steps, then
  served; a model to unload stops being reported at once, and the loop drops it between steps (its graphs,
  arena and weights go; a load waits for the unloads sent before it, so their memory is free). An item of a
  model this worker does not serve at the moment but knows (one it unloaded or is loading) is handed back
  unrun (``returned`` in the next poll: the scheduler requeues it uncounted), never failed.
- ``add_lora(name, data, model)`` / ``remove_lora(name)`` register and unregister an adapter (``workers.lora``,
  with ``lora_slots`` > 0): done by the step loop between steps (the engine validates it there; a ValueError naming
  the mismatch comes back to the caller); an item naming an adapter not resident waits in the engine until a slot is
  free. The adapters of ``lora_dir`` are registered at start-up. The poll lists the registered names (``loras``).
- ``poll(wait_s)`` hands over what happened since the last poll: per-item progress, finished items
  as PNG bytes, the latest preview of running items that asked for them (key, step, PNG bytes; encoded
  by the poll, only the latest of each item, never by the step loop),
  failed items with their error (an error raised for that item), crashed items (a step they were in
  raised: the batch's fault until shown otherwise, so the scheduler requeues them), step durations,
  seconds spent stepping out of the seconds since the last poll, the engine's counters, and for each
  finished item when the engine took it and when its PNG was ready (``time.time()``). A long
  poll: it answers at once when an item has ended, else when one ends or ``wait_s`` has passed.

Finished images are encoded to PNG off the step loop, by a few encoder threads (Pillow releases the
interpreter lock while it compresses), so the GPU's next step does not wait for the last one's PNGs; an
item counts as finished once its PNG is ready. ``png_compress_level`` trades size for time: zlib level 1
encodes a 1024 px image about 6x faster than Pillow's default 6, for files about 15% larger.

The worker keeps no durable state: the scheduler holds the leases, the store holds the truth. If
the actor dies, its items return to the queue. Heavy imports (torch, the engine) happen inside
the actor process, so importing this module is cheap.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from workers.config import WorkerConfig
from workers.request.cards import read_card
from workers.request.sizes import parse_size
from workers.request.spec import ItemSpec

# The worker's thread switch interval (Python's default: 5 ms): a long poll woken when an image ends, or a
# submit arriving, waits at most this long for the step loop's thread to hand the interpreter lock over.
SWITCH_INTERVAL_S = 0.001
# zlib level of the PNGs (0-9; Pillow's default is 6). Measured on a 2-core development machine: a 256 px
# image 23 ms at 6, 3.7 ms at 1 (files +20%); a 1024 px one 358 ms at 6, 53 ms at 1 (+16%)
PNG_COMPRESS_LEVEL = 1


# a precision the speed picked, where the GPU lacks it (bf16 runs everywhere)
FALLBACK = {"fp8+attention": "fp8", "fp8": "bf16"}

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: WorkerConfig):
        import torch

        from workers.engine import Engine, auto_backend
        from workers.families import family_named
        from workers.loading import load_model
        from workers.families.memory import check_fits
        from workers.speed.apply import to_precision

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        cuda = torch.cuda.is_available()
        self.device = ("cuda" if cuda else "cpu") if config.device == "auto" else config.device
        cards = [read_card(m) for m in config.models]
        for card in cards:  # what an operator should know of how a model is served (an edit model as text-to-image)
            for warning in card.warnings:
                log.warning("%s: %s", card.name, warning)
        dtypes = [self._dtype(config.dtype, card) for card in cards]
        if self.device.startswith("cuda"):  # several models per worker only if their weights fit
            check_fits(list(config.models), [str(d).removeprefix("torch.") for d in dtypes],
                       torch.cuda.mem_get_info(torch.device(self.device))[0], self.device,
                       encoders_here=config.text_encoder_device in ("", self.device))
        speeds = [self._speed(config, m, family_named(card.family)) for m, card in zip(config.models, cards)]

        def load(spec, dtype, own):
            model = load_model(spec, device=self.device, dtype=dtype,
                               encoder_device=config.text_encoder_device or None, precision=own.precision)
            to_precision(model, model.precision)  # FP8 now: its bf16 weights go before the next loads
            return model, own

        jobs = list(zip(config.models, dtypes, speeds))
        self._load = load
        first, own = load(*jobs[0])
        self.backend = auto_backend(self.device) if config.backend == "auto" else config.backend
        self.config = config
        self._sizes = [parse_size(s) for s in config.warm_sizes]
        self.engine = Engine([first], config, speed={first.name: own})
        t0 = time.perf_counter()
        self.engine.warmup(sizes=self._sizes)
        log.info("worker ready: %s on %s (%s), warm-up %.1f s%s", first.name, self.device, self.backend,
                 time.perf_counter() - t0, f"; loading {len(jobs) - 1} more model(s) while it serves"
                 if len(jobs) > 1 else "")
        self._loras = self._lora_dir(config.lora_dir)  # the adapters registered, as the last step loop saw them
        self._specs = {first.name: config.models[0]}  # loaded model name -> its entry in config.models
        self._ready = [first.name]  # the models it serves now (the engine's, as the step loop added them)
        self._loading = [spec for spec, _, _ in jobs[1:]]  # what it has yet to serve
        self._names = {spec: card.name for spec, card in zip(config.models, cards)}  # spec -> the name it serves as
        self._known = set(self._names.values())  # models of this worker (served, loading or unloaded): an item of one
        # it does not serve now is handed back, not failed
        self._cancelled: set[str] = set()  # specs unloaded before their load ended: dropped when they arrive
        self._unloads = 0  # unloads sent and not yet done by the step loop: a load waits for them (their memory)
        self._returned: list[str] = []  # items handed back unrun (a model it does not serve now), not polled yet
        self._models_version = 0  # bumped when the served models change: a long poll answers then
        self._load_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._load_failed = ""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  # notified when an item ends: wakes a long poll
        self._progress: dict[str, tuple[int, int]] = {}
        self._finished: list[tuple[str, bytes]] = []
        self._previews: dict[str, tuple[int, object]] = {}  # item key -> its latest (step, uint8 image) not
        # polled yet: encoded by the poll that takes it, so the step loop never encodes one
        self._admitted: dict[str, tuple[float, float]] = {}  # item key -> (submit received, engine took it), time.time()
        self._timings: dict[str, tuple[float, float, float]] = {}  # finished item -> (received, admitted, PNG
        # ready), not polled yet
        self._failed: list[tuple[str, str]] = []
        self._ready_told = 0  # the models' version the last poll reported
        self._crashed: list[tuple[str, str]] = []
        self._step_seconds: list[float] = []
        self._busy_s, self._since = 0.0, time.perf_counter()
        self._png_level = config.png_compress_level
        self._encoder = ThreadPoolExecutor(max_workers=config.png_threads or max(1, min(4, os.cpu_count() or 1)),
                                           thread_name_prefix="png")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()
        for job in jobs[1:]:  # the first model serves while the others load, one after another
            self._load_queue.put(job)
        self._loader = threading.Thread(target=self._load_rest, name="load", daemon=True)
        self._loader.start()

    def _load_rest(self) -> None:
        """The loader thread: each model after the first (and each ``load`` asks for), loaded here and handed to
        the step loop, which adds it to the engine and warms it between steps. A model that fails to load is
        reported by the next poll (``load_failed``): the scheduler then drops the worker as one that failed to
        start; nothing more is loaded."""
        while not self._stop.is_set():
            try:
                spec, dtype, own = self._load_queue.get(timeout=0.2)
            except queue.Empty:
                continue
            with self._lock:
                while self._unloads and not self._stop.is_set():  # their memory first
                    self._news.wait(0.2)
                if spec in self._cancelled or self._load_failed:  # unloaded before it began
                    self._cancelled.discard(spec)
                    if spec in self._loading:
                        self._loading.remove(spec)
                        self._models_version += 1
                    continue
            try:
                if self.device.startswith("cuda"):
                    import torch

                    from workers.families.memory import check_fits

                    check_fits([spec], [str(dtype).removeprefix("torch.")],
                               torch.cuda.mem_get_info(torch.device(self.device))[0], self.device,
                               encoders_here=self.config.text_encoder_device in ("", self.device))
                model, own = self._load(spec, dtype, own)
            except Exception as e:
                log.exception("loading %s failed", spec)
                with self._lock:
                    self._load_failed = f"loading model {spec} failed: {type(e).__name__}: {str(e)[:500]}"
                    self._news.notify_all()
                continue
            self._inbox.put(("model", (spec, model, own)))

    def _dtype(self, name: str, card):
        """``auto``: the model card's dtype on CUDA, float32 on a CPU."""
        import torch

        from workers.loading import run_dtype

        return run_dtype(card, self.device) if name == "auto" else getattr(torch, name)

    def _speed(self, config: WorkerConfig, model: str, family):
        """``model``'s speed-layer config on this worker's device: the speed's FP8 where the GPU has it (a
        precision the speed picked falls back, FP8 attention to FP8 linears, then to bf16, and says so; one the
        config names is refused by ``load_model``)."""
        from workers.speed.apply import unsupported_reason

        precision, own = config.precision_for(model, family)
        precision = precision or "bf16"
        while not own and (why := unsupported_reason(precision, self.device)) is not None:
            fallback = FALLBACK[precision]
            log.warning("%s: %s is not available on %s (%s); running %s", model, precision, self.device, why, fallback)
            precision = fallback
        return replace(config.speed_for(model, family), precision=precision)

    # -- the actor's methods (called by the scheduler) ---------------------------------------------
    def info(self) -> dict:
        """Returns once the worker is ready (Ray runs methods after ``__init__``)."""
        from workers.kernels.attention import CHOOSER

        with self._lock:  # the step loop adds models: a copy of what it serves now
            ready, loading = list(self._ready), list(self._loading)
            models = {name: self.engine.models[name] for name in ready}
            speeds = {name: self.engine.speed[name] for name in ready}
            specs = dict(self._specs)
        return {"models": sorted(ready), "loading": loading, "device": self.device, "backend": self.backend,
                "backends": {name: self.engine.backend_for(m) for name, m in models.items()},
                "attention": {k: v for k, v in self.engine.attention.items() if k in models},
                "attention_kernels": CHOOSER.summary(),  # measured at warm-up: once, not in every poll's stats
                "precision": {name: m.precision for name, m in models.items()},
                "speed": {name: self.config.speed_of(specs[name]) for name in ready},
                "compiled": {name: speed.compile != "off" for name, speed in speeds.items()},
                "decode_graphs": {name: speed.decode_graphs for name, speed in speeds.items()}}

    def wait_models(self, timeout: float = 600.0) -> list[str]:
        """Block until every model of the config is served (tools and tests; the scheduler reads ``poll``);
        RuntimeError when one failed to load, TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._loading and not self._load_failed:
                if (left := deadline - time.monotonic()) <= 0:
                    raise TimeoutError(f"still loading {', '.join(self._loading)} after {timeout:.0f} s")
                self._news.wait(left)
            if self._load_failed:
                raise RuntimeError(self._load_failed)
            return sorted(self._ready)

    def load(self, specs: list[str]) -> list[bool]:
        """Serve ``specs`` too (entries as ``[workers] models`` takes them), once loaded and warm; the poll that
        follows says so (``models``). A model it serves or loads already is left as it is."""
        from workers.families import family_named

        out = []
        for spec in specs:
            card = read_card(spec)
            with self._lock:
                self._cancelled.discard(spec)
                if card.name in self._ready or spec in self._loading:
                    out.append(False)
                    continue
                self._names[spec] = card.name
                self._known.add(card.name)
                self._loading.append(spec)
                self._models_version += 1
            self._load_queue.put((spec, self._dtype(self.config.dtype, card),
                                  self._speed(self.config, spec, family_named(card.family))))
            out.append(True)
        return out

    def unload(self, names: list[str]) -> list[bool]:
        """Stop serving the models ``names``: no poll reports them from now on, and the step loop drops them
        between steps (an item of theirs still here is handed back: ``returned``). One still loading is
        dropped when its load ends."""
        with self._lock:
            for name in names:
                if name in self._ready:
                    self._ready.remove(name)
                self._cancelled |= {spec for spec in self._loading if self._names.get(spec) == name}
                self._unloads += 1
            self._models_version += 1
            self._news.notify_all()
        for name in names:
            self._inbox.put(("unload", name))
        return [True] * len(names)

    def submit(self, items: list[ItemSpec]) -> list[bool]:
        now = time.time()
        for item in items:
            self._inbox.put(("add", (item, now)))
        return [True] * len(items)

    def cancel(self, ids: list[str]) -> list[bool]:
        for item_id in ids:
            self._inbox.put(("cancel", item_id))
        return [True] * len(ids)

    def add_lora(self, name: str, data: bytes, model: str | None = None, timeout: float = 120.0) -> dict:
        """Register the adapter ``data`` (safetensors bytes) as ``name`` for ``model`` (None: the model its metadata
        names, else every served model it fits); done by the step loop between steps. Its ``Engine.loras`` entry;
        ValueError naming the mismatch."""
        return self._on_loop("lora_add", (name, data, model), timeout)

    def remove_lora(self, name: str, timeout: float = 120.0) -> bool:
        """Unregister ``name`` (it leaves its slot once no item uses it); False if it was not registered."""
        return self._on_loop("lora_remove", name, timeout)

    def _on_loop(self, kind: str, payload, timeout: float):
        done: Future = Future()
        self._inbox.put((kind, (payload, done)))
        return done.result(timeout)

    def _lora_dir(self, folder: str) -> list[str]:
        """Register every ``*.safetensors`` of ``folder`` (named by its stem); one that does not fit is logged."""
        from pathlib import Path

        if folder and self.engine.lora is not None:
            for path in sorted(Path(folder).glob("*.safetensors")):
                try:
                    self.engine.add_lora(path.stem, path)
                except ValueError as e:
                    log.warning("adapter %s not registered: %s", path.name, e)
        elif folder:
            log.warning("lora_dir %s ignored: lora_slots is 0", folder)
        return sorted(self.engine.loras())

    def _lora(self, kind: str, payload) -> None:
        """The step loop: an adapter registered or removed, its result handed to the waiting caller."""
        args, done = payload
        try:
            if kind == "lora_add":
                result = self.engine.add_lora(*args)
            else:
                try:
                    self.engine.remove_lora(args)
                    result = True
                except KeyError:
                    result = False
        except Exception as e:
            done.set_exception(e)
        else:
            done.set_result(result)
        with self._lock:
            self._loras = sorted(self.engine.loras())

    def poll(self, wait_s: float = 0.0) -> dict:
        """What happened since the last poll. With ``wait_s``, a long poll: it answers as soon as an item
        finished, failed or crashed, or after ``wait_s`` (progress and previews ride along). The scheduler
        calls it in the actor's ``poll`` concurrency group, so a waiting poll never holds up ``submit`` and
        ``cancel`` (which keep their order in the default group)."""
        with self._lock:
            if wait_s > 0 and not (self._finished or self._failed or self._crashed or self._returned
                                   or self._stop.is_set() or self._load_failed
                                   or self._models_version != self._ready_told):
                self._news.wait(wait_s)
            now = time.perf_counter()
            previews = self._previews
            self._ready_told = self._models_version
            report = {"progress": dict(self._progress), "finished": self._finished, "failed": self._failed,
                      "returned": self._returned,
                      "timings": self._timings, "models": sorted(self._ready), "loading": list(self._loading),
                      "loras": list(self._loras),
                      **({"load_failed": self._load_failed} if self._load_failed else {}),
                      "crashed": self._crashed, "step_seconds": self._step_seconds, "busy_s": self._busy_s,
                      "window_s": now - self._since, "stats": self.engine.stats(), "answered": time.time()}
            self._finished, self._failed, self._crashed, self._step_seconds = [], [], [], []
            self._timings, self._returned = {}, []
            self._previews = {}
            self._busy_s, self._since = 0.0, now
        report["previews"] = [(k, step, _png(image, self._png_level)) for k, (step, image) in previews.items()]
        return report

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._news.notify_all()
        self._thread.join(timeout=10)
        self._encoder.shutdown(wait=False, cancel_futures=True)  # unreported items go back with their leases

    # -- the step loop (its own thread) -------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self.engine.num_active)
            if self.engine.num_active:
                self._step()

    def _admit(self, block: bool) -> None:
        """Apply queued submits and cancels (in order; the submits between two cancels are admitted
        together, so a family encodes their conditioning in one batch); wait briefly when idle."""
        try:
            msg = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        adds: list[ItemSpec] = []
        while msg is not None:
            kind, payload = msg
            if kind == "add":
                adds.append(payload)
            elif kind == "model":
                self._add(adds)
                adds = []
                self._serve(*payload)
            elif kind == "unload":
                self._add(adds)
                adds = []
                self._unload(payload)
            elif kind in ("lora_add", "lora_remove"):
                self._add(adds)
                adds = []
                self._lora(kind, payload)
            else:
                self._add(adds)
                adds = []
                self._cancel(payload)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                msg = None
        self._add(adds)

    def _serve(self, spec: str, model, own) -> None:
        """The step loop: a model the loader thread made, added to the engine and warmed, then served."""
        with self._lock:
            if spec in self._cancelled:  # unloaded while it loaded
                self._cancelled.discard(spec)
                if spec in self._loading:
                    self._loading.remove(spec)
                self._models_version += 1
                self._news.notify_all()
                log.info("%s loaded after it was unloaded: dropped", model.name)
                return
        t0 = time.perf_counter()
        try:
            self.engine.add_model(model, own, sizes=self._sizes)
        except Exception as e:
            log.exception("adding %s failed", spec)
            with self._lock:
                self._load_failed = f"warming model {spec} failed: {type(e).__name__}: {str(e)[:500]}"
                self._news.notify_all()
            return
        log.info("%s ready too, warm-up %.1f s", model.name, time.perf_counter() - t0)
        with self._lock:
            self._specs[model.name] = spec
            self._ready.append(model.name)
            self._loading.remove(spec)
            self._models_version += 1
            self._news.notify_all()

    def _unload(self, name: str) -> None:
        """The step loop: ``name`` leaves the engine; its items still here are handed back unrun (``returned``),
        its text encoder is forgotten unless another model shares it, and its memory goes."""
        import gc

        try:
            if name in self.engine.models:
                ids = [a.req.id for g in self.engine.groups.values() if g.model.name == name for a in g.active]
                for item_id in ids:
                    self.engine.cancel(item_id)
                with self._lock:
                    self._returned += ids
                    for item_id in ids:
                        self._progress.pop(item_id, None)
                        self._previews.pop(item_id, None)
                        self._admitted.pop(item_id, None)
                self.engine.remove_model(name)
                from workers.families.encoders import release_unused

                release_unused([m.text_encoder for m in self.engine.models.values() if m.text_encoder is not None])
                gc.collect()
                if self.device.startswith("cuda"):
                    import torch

                    torch.cuda.empty_cache()
                log.info("unloaded %s", name)
        finally:
            with self._lock:
                self._specs.pop(name, None)
                self._unloads -= 1
                self._news.notify_all()

    def _cancel(self, item_id: str) -> None:
        self.engine.cancel(item_id)
        with self._lock:
            self._progress.pop(item_id, None)
            self._admitted.pop(item_id, None)
            self._previews.pop(item_id, None)

    def _add(self, received: list[tuple[ItemSpec, float]]) -> None:
        """Admit items together; if that fails, one by one, so a bad item fails alone. An item of a model this
        worker knows but does not serve now (unloaded, or still loading) is handed back, not failed."""
        away = {it.id for it, _ in received if it.model and it.model not in self.engine.models and it.model in self._known}
        if away:
            received = [(it, t) for it, t in received if it.id not in away]
            with self._lock:
                self._returned += sorted(away)
                self._news.notify_all()
        if not received:
            return
        items, arrived = [it for it, _ in received], {it.id: t for it, t in received}
        try:
            self.engine.add_many(items)
        except (KeyError, ValueError):
            for it in items:
                try:
                    self.engine.add(it)
                except (KeyError, ValueError) as e:
                    with self._lock:
                        self._failed.append((it.id, f"{type(e).__name__}: {e}"))
                        self._news.notify_all()
                    continue
                with self._lock:
                    self._progress[it.id] = (0, it.steps)
                    self._admitted[it.id] = (arrived[it.id], time.time())
            return
        now = time.time()
        with self._lock:
            self._progress.update({it.id: (0, it.steps) for it in items})
            self._admitted.update({it.id: (arrived[it.id], now) for it in items})

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            results = self.engine.step(self._on_progress)
        except Exception as e:  # a step that raises drops its items (requeued by the scheduler), not the worker
            log.exception("engine step failed")
            self._drop_all(f"engine step failed: {type(e).__name__}: {str(e)[:500]}")
            return
        dt = time.perf_counter() - t0
        previews = {p.request_id: (p.step, p.image) for p in self.engine.take_previews()}  # latest per item
        with self._lock:
            self._step_seconds.append(dt)
            self._busy_s += dt
            self._previews.update(previews)
        for r in results:  # encoded off this thread: the next step starts now
            self._encoder.submit(self._deliver, r.request.id, r.image)

    def _deliver(self, item_id: str, image) -> None:
        """An encoder thread: the item's PNG, then it counts as finished (or failed, if it cannot be encoded)."""
        try:
            png, error = _png(image, self._png_level), None
        except Exception as e:  # the item's own failure, not the worker's
            log.exception("encoding item %s failed", item_id)
            png, error = None, f"the image could not be encoded: {type(e).__name__}: {str(e)[:300]}"
        ready = time.time()
        with self._lock:
            if error is None:
                self._finished.append((item_id, png))
                self._timings[item_id] = (*self._admitted.pop(item_id, (ready, ready)), ready)
            else:
                self._failed.append((item_id, error))
                self._admitted.pop(item_id, None)
            self._progress.pop(item_id, None)
            self._previews.pop(item_id, None)
            self._news.notify_all()

    def _on_progress(self, item_id: str, done: int, total: int) -> None:
        with self._lock:
            self._progress[item_id] = (done, total)

    def _drop_all(self, error: str) -> None:
        ids = list(self.engine.progress())
        for item_id in ids:
            self.engine.cancel(item_id)
        with self._lock:
            self._crashed += [(i, error) for i in ids]
            for i in ids:
                self._progress.pop(i, None)
                self._previews.pop(i, None)
                self._admitted.pop(i, None)
            self._news.notify_all()




def _png(image, level: int = PNG_COMPRESS_LEVEL) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=level)
    return buf.getvalue()


def remote_worker_class():
    """``Worker`` as a Ray actor class (ray imported only when a scheduler asks for it)."""
    import ray

    # no task events: the scheduler polls each worker many times a second, and the GCS would keep a record
    # of every call (up to 100,000 by default, ~3 KiB each): hundreds of MB before it levels off
    # calls of the ``poll`` group run on their own thread (a long poll waits there); the default group keeps
    # one thread, so submits and cancels run in the order they were sent
    return ray.remote(max_restarts=0, enable_task_events=False, concurrency_groups={"poll": 1})(Worker)
