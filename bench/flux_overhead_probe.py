"""A probe of FLUX.1-dev 512's time outside its steps in the mixed workload, on a GPU (run as written, once, on
an H200): the text encoders (CLIP + T5-XXL at 512 tokens, ``workers.families.flux._encode_texts``) on 1, 3, 5
and 8 fresh prompts; the VAE decode of 8 latents at two of the mixed sizes plain, as ``decode`` makes images,
captured (``decode_runner``) and compiled then captured (``decode_runner(compiled=True)``); then
bench/mmdit.py's mixed backlog (24 images, 8 in flight) through plain breakable graphs, with and without
``decode_graphs``, timing the admissions (encoding) and the finishing (decode) apart, synchronised.
Median ms of 5 calls after 1.

    python bench/flux_overhead_probe.py [OUT_DIR]   # writes OUT_DIR/flux_overhead_probe.json

Its result is docs/benchmarks/flux_overhead_probe.json (the run's keys renamed to these); what it led to: docs/design.md, "The VAE decode in graphs".
"""
import importlib.util, itertools, json, statistics, sys, time
from pathlib import Path

import torch

from workers.engine import Engine, EngineConfig, _vae_pixels, decode, decode_runner
from workers.families import flux
from workers.loading import load_model

_spec = importlib.util.spec_from_file_location("mmdit_bench", Path(__file__).parent / "mmdit.py")
mb = sys.modules.setdefault("mmdit_bench", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(mb)
pb = mb.pb  # bench/pixart.py: prompts, free()

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks")
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
sync = torch.cuda.synchronize


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "flux_overhead_probe.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)


def ms(fn, reps=5):
    fn(); sync(); r = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); sync(); r.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(r), 2)


t0 = time.perf_counter()
model = load_model("flux-dev-512", device="cuda", dtype=torch.bfloat16)
sync()
res["load_s"] = round(time.perf_counter() - t0, 1)
prompts, s = pb.make_prompts(), mb.Setup()
fresh = (f"{q} #{n}" for n, q in enumerate(itertools.cycle(prompts)))  # never in the cache
for k in (1, 3, 5, 8):
    def enc():
        model.cache.clear()
        flux._encode_texts(model, [next(fresh) for _ in range(k)])
    res[f"encode_{k}_ms"] = ms(enc)
save()
made = tuple(model.card.size_for(w, h) for w, h in s.mixed_sizes)
for w, h in made[:2]:
    shape = model.card.latent_shape(w, h)
    lat = torch.randn(8, *shape, device="cuda")
    with torch.no_grad():
        res[f"decode8_{w}x{h}_eager_ms"] = ms(lambda: _vae_pixels(model, lat))
        res[f"decode8_{w}x{h}_images_ms"] = ms(lambda: decode(model, lat, [(0, 0)] * 8))
    plain = decode_runner(model, shape)
    plain.warmup()
    res[f"decode8_{w}x{h}_graph_ms"] = ms(lambda: plain.run(latents=lat))
    t1 = time.perf_counter()
    compiled = decode_runner(model, shape, compiled=True)
    compiled.warmup()
    res[f"decode_compile_s_{w}x{h}"] = round(time.perf_counter() - t1, 1)
    res[f"decode8_{w}x{h}_compiled_graph_ms"] = ms(lambda: compiled.run(latents=lat))
    res[f"decode8_{w}x{h}_compiled_maxdiff"] = (compiled.run(latents=lat)["pixels"] - _vae_pixels(model, lat)).abs().max().item()
    del plain, compiled
    save()
for dg in (False, True):
    eng = Engine(model, EngineConfig(backend="breakable", max_batch=8, decode_graphs=dg))
    eng.warmup(sizes=made)
    sync()
    spent = {"encode": 0.0, "finish": 0.0}

    def timed(fn, key):
        def wrapped(*a):
            sync(); t = time.perf_counter(); out = fn(*a); sync()
            spent[key] += time.perf_counter() - t
            return out
        return wrapped

    eng.add_many, eng._finish = timed(eng.add_many, "encode"), timed(eng._finish, "finish")
    jobs = mb.backlog(made, len(prompts))
    model.cache.clear()
    t1 = time.perf_counter()
    mb.run_engine(eng, model, jobs, prompts, s, 300)
    sync()
    res[f"backlog_decode_graphs_{int(dg)}"] = {"total_s": round(time.perf_counter() - t1, 3),
                                               **{f"{k}_s": round(v, 3) for k, v in spent.items()},
                                               "images": sum(j.n for j in jobs)}
    save()
    del eng
    pb.free()
