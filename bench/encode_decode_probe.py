"""A probe of one PixArt-Σ 512 image's time outside its steps, on a GPU (run as written, once, on an H200):
the VAE decode of one latent plain, captured in a CUDA graph, with channels-last weights, and compiled by
Inductor (on the channels-last weights) then captured; and T5's encoding of a prompt and "" padded to 300
tokens against ``workers.families.pixart.real_length_encode`` (which, when the probe ran, encoded the real
length itself, not yet rounded up to a multiple of 64). Median ms of 7 calls after 2, synchronised.

    python bench/encode_decode_probe.py [OUT_DIR]   # writes OUT_DIR/encode_decode_probe_pixart512.json

Its result is docs/benchmarks/encode_decode_probe_pixart512.json (the probe wrote it under another name then);
what it led to: docs/design.md, "The text encoder in graphs" and "The VAE decode in graphs".
"""
import json, os, statistics, sys, time, torch
from workers.loading import load_model
from workers.engine import _vae_pixels
from workers.families import pixart
sync = torch.cuda.synchronize
def ms(fn, reps=7):
    fn(); fn(); sync(); r = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); sync(); r.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(r), 2)
def graph_ms(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return ms(g.replay)
out = {}
model = load_model("pixart-sigma-512", device="cuda", dtype=torch.bfloat16)
out["vae_dtype"] = str(model.vae.dtype)
lat = torch.randn(1, 4, 64, 64, device="cuda")
with torch.no_grad():
    out["nchw_eager"] = ms(lambda: _vae_pixels(model, lat))
    out["nchw_graph"] = graph_ms(lambda: _vae_pixels(model, lat))
    ref = _vae_pixels(model, lat)
    model.vae.to(memory_format=torch.channels_last)
    out["cl_eager"] = ms(lambda: _vae_pixels(model, lat))
    out["cl_eager_cl_input"] = ms(lambda: _vae_pixels(model, lat.contiguous(memory_format=torch.channels_last)))
    out["cl_graph"] = graph_ms(lambda: _vae_pixels(model, lat))
    out["cl_maxdiff"] = (_vae_pixels(model, lat) - ref).abs().max().item()
    print(json.dumps(out), flush=True)
    dec = model.vae.decoder
    t0 = time.perf_counter()
    model.vae.decoder = torch.compile(dec)
    _vae_pixels(model, lat); sync()
    out["compile_s"] = round(time.perf_counter() - t0, 1)
    out["cl_compiled_eager"] = ms(lambda: _vae_pixels(model, lat))
    out["cl_compiled_graph"] = graph_ms(lambda: _vae_pixels(model, lat))
    out["compiled_maxdiff"] = (_vae_pixels(model, lat) - ref).abs().max().item()
    model.vae.decoder = dec
    print(json.dumps(out), flush=True)
    # T5 encode: padded to 300 vs real length
    texts = ["a photo of a cat sitting on a red chair in the sun", ""]
    def full():
        tok = model.tokenizer(texts, padding="max_length", max_length=300, truncation=True, return_tensors="pt")
        m = tok.attention_mask.cuda(); model.text_encoder(tok.input_ids.cuda(), attention_mask=m)
    out["t5_300_ms"] = ms(full)
    out["t5_real_ms"] = ms(lambda: pixart.real_length_encode(model, texts))
    out["t5_dtype"] = str(model.text_encoder.dtype)
print(json.dumps(out), flush=True)
out_dir = sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks"
json.dump(out, open(os.path.join(out_dir, "encode_decode_probe_pixart512.json"), "w"), indent=1)
