"""Request and response models shared by the server and the client SDK.

Imports pydantic only (no torch, no ray), so the SDK installs and imports on a laptop. Requests
forbid unknown fields: a typo such as ``num_per_lable`` is a 400, not a silently ignored option.
Static checks (types, signs, lengths) live here; checks that need the deployment's configuration
or the model's classes (limits, label names) are made once by the API (``dit_serve.server.catalog``).
Every number a request carries is finite and bounded and every string and list has a maximum length,
so nothing a request contains can be stored in a form that cannot be read back.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

State = Literal["queued", "running", "done", "failed", "cancelled"]
TERMINAL_STATES = ("done", "failed", "cancelled")
MAX_SEED = 2**63 - 1  # seeds are stored as signed 64-bit integers
MAX_ITEMS = 1_000_000  # the most items a request may describe; [limits] max_items_per_job is lower
MAX_STEPS = 10_000
MAX_GUIDANCE = 100.0
MAX_PREVIEW_EVERY = 1000
MAX_NAME = 200  # model names, class names
# characters, for /v1/jobs' prompts and /v1/images/generations' prompt alike (OpenAI's own bound for its
# images API); the model's tokenizer then truncates to its token limit, as the reference does, with a warning.
# GET /v1/models says it per model (max_prompt_chars).
MAX_PROMPT = 32000
# An edit's input image sent inline (base64 or a data URL) in a JSON body: the schema's static bound on the
# text; the service's own limit on the decoded bytes is lower ([limits] max_inline_image_bytes, 413 past it).
MAX_INLINE_CHARS = 64 << 20
# the schema's bound on an edit's input images (an instruction edit's references); a model's card says how many it
# takes (GET /v1/models: max_images, 1 for most; Qwen-Image-Edit-Plus 3)
MAX_INPUT_IMAGES = 8
UPLOAD_ID = r"^upl_[0-9a-f]{24}$"  # an id POST /v1/uploads answers
LORA_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # an adapter's name (POST /v1/loras; a lora_dir file's stem)
MAX_LORA_SCALE = 4.0  # a request's adapter scale is in [-4, 4]
MAX_LORAS = 16  # the schema's bound on a request's adapters; [workers] lora_per_request is the service's


def input_name(index: int) -> str:
    """The name a job's ``index``-th input image (from 0) is stored and served under (GET
    /v1/jobs/{id}/inputs/{name}): image, image2, image3, ..."""
    return "image" if index == 0 else f"image{index + 1}"


INPUT_NAME = rf"^(image[2-{MAX_INPUT_IMAGES}]?|mask)$"  # every name input_name gives, and the mask's


def clip(text: str, n: int = 100) -> str:
    """``text`` cut to ``n`` characters, for messages that echo what a user sent."""
    return text if len(text) <= n else text[: n - 3] + "..."


def _label(value):
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"a label is a class number or a class name, not {clip(repr(value), 60)}")
    if isinstance(value, int) and not 0 <= value < 2**31:
        raise ValueError(f"a class number is between 0 and the model's number of classes, not {clip(str(value), 40)}")
    if isinstance(value, str) and not 0 < len(value) <= MAX_NAME:
        raise ValueError(f"a class name has 1 to {MAX_NAME} characters")
    return value


# the branches carry what _label checks, so the schema says it too
Label = Annotated[Annotated[int, Field(ge=0, lt=2**31)] | Annotated[str, Field(min_length=1, max_length=MAX_NAME)],
                  BeforeValidator(_label)]


def _prompt(value):
    if not isinstance(value, str) or not value.strip():
        raise ValueError("a prompt is a non-empty string")
    return value


NOT_BLANK = r"\S"  # a search, as JSON Schema's pattern is: some character that is not a space
Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT, pattern=NOT_BLANK), BeforeValidator(_prompt)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a newer server may add fields; older clients still parse


class LoraRef(_Request):
    """An adapter a request applies (``GET /v1/loras`` lists those the caller may name), at ``scale``."""

    name: str = Field(min_length=1, max_length=64, pattern=LORA_NAME, description="a registered adapter's name")
    scale: float = Field(1.0, json_schema_extra={"minimum": -MAX_LORA_SCALE, "maximum": MAX_LORA_SCALE},
                         description="how much of the adapter: its term times this, in [-4, 4]")

    @model_validator(mode="after")
    def _check_scale(self) -> "LoraRef":  # here, not as a field bound: the message names the adapter
        if not -MAX_LORA_SCALE <= self.scale <= MAX_LORA_SCALE:
            raise ValueError(f"adapter {self.name!r}: scale {self.scale:g} is outside [-{MAX_LORA_SCALE:g}, "
                             f"{MAX_LORA_SCALE:g}]")
        return self


Loras = Field(None, min_length=1, max_length=MAX_LORAS,
              description="adapters (LoRA) applied to every image: [{\"name\": ..., \"scale\": 0.8}]; at most "
                          "[workers] lora_per_request of them, each registered for the job's model (GET /v1/loras)")


InlineImage = Annotated[str, Field(min_length=1, max_length=MAX_INLINE_CHARS)]
InlineImages = Annotated[list[InlineImage], Field(min_length=1, max_length=MAX_INPUT_IMAGES)]


class JobRequest(_Request):
    """N images of one model with shared sampling parameters: ``labels`` (class models) each repeated
    ``num_per_label`` times, or ``prompts`` (text models) each repeated ``num_per_prompt`` times, in
    order; item i uses ``seeds[i]``, else ``seed + i``."""

    model: str | None = Field(None, min_length=1, max_length=MAX_NAME,
                              description="a model listed by GET /v1/models; the service's first when omitted")
    labels: list[Label] | None = Field(None, min_length=1, max_length=MAX_ITEMS,
                                       description="class models: class numbers or class names")
    num_per_label: int = Field(1, ge=1, le=MAX_ITEMS)
    prompts: list[Prompt] | None = Field(None, min_length=1, max_length=MAX_ITEMS,
                                         description="text models: what to draw (over the model's token limit: cut "
                                                     "there, as the reference pipelines do, with a warning in "
                                                     "the job's params)")
    num_per_prompt: int = Field(1, ge=1, le=MAX_ITEMS)
    negative_prompt: str = Field("", max_length=MAX_PROMPT, description="text models: what to steer away "
                                                                        "from; empty is the unconditional prompt")
    width: int | None = Field(None, ge=8, le=4096, description="pixels; the model's size when omitted")
    height: int | None = Field(None, ge=8, le=4096, description="pixels; the model's size when omitted")
    exact_size: bool = Field(False, description="models with aspect-ratio bins generate at the bin nearest "
                                                "width x height; true resizes (and centre-crops) the result to "
                                                "exactly width x height")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="item i uses seed + i; a random seed (recorded "
                                                                   "in each item) when omitted")
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] | None = Field(
        None, min_length=1, max_length=MAX_ITEMS, description="one seed per item; overrides `seed`")
    sampler: str | None = Field(None, max_length=50, description="ddpm, ddim, euler, euler_a, dpmpp_2m, "
                                                                 "flow_euler, flow_dpmpp_2m, scm; the model's "
                                                                 "default when omitted")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    guidance: float | None = Field(None, ge=0, le=MAX_GUIDANCE, description="classifier-free guidance scale")
    eta: float = Field(0.0, ge=0, le=1, description="DDIM eta (0 = deterministic, 1 = DDPM-like)")
    priority: int = Field(0, ge=-100, le=100, description="higher runs first; first come, first served "
                                                          "within a priority")
    preview_every: int = Field(0, ge=0, le=MAX_PREVIEW_EVERY,
                               description="N > 0: a small preview of each running image every N steps "
                                           "(`preview` events, GET /v1/jobs/{id}/items/{i}/preview); 0: none")
    webhook_url: str | None = Field(None, max_length=2000, pattern=r"^https?://[^\s]+$",
                                    description="POSTed the finished job (JSON) once it is done, failed or "
                                                "cancelled; retried with backoff until it answers 2xx")
    image: InlineImage | InlineImages | None = Field(
        None, description="edits (models whose card says takes_image): the input image, as an upload's id (POST "
                    "/v1/uploads, 'upl_...') or a data URL ('data:image/png;base64,...'); PNG, JPEG or WebP. "
                    "Image-to-image, or inpainting with `mask`. A list: an instruction edit's reference images in "
                    "order, image 1 first, for models that take several (GET /v1/models: max_images)")
    image_b64: InlineImage | InlineImages | None = Field(
        None, description="the input image as base64, or a list of them (instead of `image`)")
    mask: str | None = Field(None, min_length=1, max_length=MAX_INLINE_CHARS,
                             description="inpainting (models whose card says takes_mask): an upload's id or a data "
                                         "URL of an image of the input image's size; white = repaint, black = "
                                         "keep")
    mask_b64: str | None = Field(None, min_length=1, max_length=MAX_INLINE_CHARS,
                                 description="the mask as base64 (instead of `mask`)")
    strength: float | None = Field(None, gt=0, le=1,
                                   description="edits: how much of the schedule runs, in (0, 1]: 1 repaints "
                                               "from pure noise, 0.3 stays close to the input; default 0.6 for "
                                               "image-to-image, 1.0 for inpainting")
    loras: list[LoraRef] | None = Loras

    @property
    def num_items(self) -> int:
        if self.prompts is not None:
            return len(self.prompts) * self.num_per_prompt
        return len(self.labels or ()) * self.num_per_label

    @model_validator(mode="after")
    def _check_seeds(self) -> "JobRequest":
        if (self.labels is None) == (self.prompts is None):
            raise ValueError("send labels (class-conditional models) or prompts (text-to-image models): "
                             f"{'both were' if self.labels else 'neither was'} given")
        if self.seeds is None:
            if self.seed is not None and self.seed + self.num_items - 1 > MAX_SEED:
                raise ValueError(f"seed + number of items must stay below 2**63, got seed {self.seed}")
            return self
        if len(self.seeds) != self.num_items:
            raise ValueError(f"seeds has {len(self.seeds)} entries but the job has {self.num_items} items "
                             "(len(labels) * num_per_label, or len(prompts) * num_per_prompt)")
        return self


class InputImage(_Response):
    """An edit's input image (or mask) as the job stores it: once per job, beside its images."""

    id: str | None = Field(None, description="the upload's id (POST /v1/uploads); null when it was sent inline "
                                             "or read from a local file")
    sha256: str = Field(description="SHA-256 of the stored bytes, hex (for an OpenAI edit's mask: of the mask "
                                    "made from its transparency)")
    width: int = Field(description="pixels, upright (EXIF orientation applied)")
    height: int


class LoraUse(_Response):
    """An adapter a job applies, as the job records it: its name, scale and the SHA-256 of its file then."""

    name: str
    scale: float
    sha256: str


class JobParams(_Response):
    """The sampling parameters a job runs with, after the model's defaults are filled in."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # stored as JSON: finite, or not at all

    sampler: str
    steps: int
    guidance: float
    eta: float = 0.0
    negative_prompt: str = ""
    width: int = Field(0, description="pixels the model generates at (0: its native size)")
    height: int = 0
    output_width: int = Field(0, description="pixels of the stored image when resized to an exact size "
                                             "(0: as generated)")
    output_height: int = 0
    preview_every: int = Field(0, description="a preview every N steps (0: none)")
    image: InputImage | None = Field(None, description="edits: the input image (null: text-to-image); "
                                                       "GET /v1/jobs/{id}/inputs/image serves it")
    extra_images: list[InputImage] = Field(default_factory=list,
                                           description="an instruction edit's further reference images, images 2, 3, "
                                                       "... in order (`image` is image 1); GET "
                                                       "/v1/jobs/{id}/inputs/image2 (image3, ...) serves them")
    mask: InputImage | None = Field(None, description="inpainting: the mask, white = repaint (null: none)")
    strength: float | None = Field(None, description="edits: the part of the schedule run, in (0, 1]")
    loras: list[LoraUse] = Field(default_factory=list, description="adapters applied to every image (name, "
                                                                    "scale, the file's SHA-256)")
    warnings: list[str] = Field(default_factory=list, description="what the service changed in the request, e.g. "
                                                                   "prompts cut at the model's token limit, and how "
                                                                   "the model is served (its card's warnings)")


class ItemStatus(_Response):
    index: int
    label: int | None = Field(None, description="class models: the class")
    prompt: str | None = Field(None, description="text models: the prompt")
    seed: int
    state: State
    step: int = Field(description="denoising steps done (equal to total_steps once done)")
    total_steps: int
    attempts: int = Field(0, description="runs started")
    requeues: int = Field(0, description="times it went back to the queue after an infrastructure failure "
                                         "(a worker or node died, a lease expired); not charged to it")
    crashes: int = Field(0, description="times a worker died (or its step raised) while holding it")
    error: str | None = None
    finished_at: float | None = Field(None, description="when it ended (done, failed or cancelled; Unix seconds)")


class WebhookStatus(_Response):
    url: str
    state: Literal["pending", "sending", "sent", "failed"]
    attempts: int = Field(description="deliveries tried so far")
    error: str | None = Field(None, description="why the last delivery failed")


class Failure(_Response):
    """One reason items of a job failed, and how many failed so."""

    error: str
    items: int = Field(description="how many items failed with this reason")
    first: int = Field(description="the lowest index of such an item")


def failure_summary(failures: list[Failure], failed: int, num_items: int, shown: int = 3) -> str:
    """One line: how many items failed and why, the most common reasons first."""
    reasons = "; ".join(f"{clip(f.error, 300)} ({f.items})" for f in failures[:shown])
    more = f"; {len(failures) - shown} other reasons" if len(failures) > shown else ""
    return f"{failed} of {num_items} items failed: {reasons}{more}"


class Job(_Response):
    id: str
    state: State
    model: str
    params: JobParams | None = Field(description="null only for a stored job that cannot be read (see error)")
    error: str | None = Field(None, description="a failed job: how many items failed and why (the reasons are in "
                                                "`failures`); or why the job could not be read back from the store")
    failures: list[Failure] = Field(default_factory=list, description="why items failed: each distinct reason "
                                                                      "with its count, the most common first")
    tenant: str = "default"
    priority: int = 0
    webhook: WebhookStatus | None = None
    created_at: float
    finished_at: float | None = None
    num_items: int
    counts: dict[str, int] = Field(description="items per state")
    steps_done: int = Field(description="denoising steps done over all items")
    steps_total: int
    items: list[ItemStatus] | None = Field(None, description="per-item progress (GET /v1/jobs/{id} only)")
    waiting: str | None = Field(None, description="why queued items wait, while no worker serves the job's model "
                                                  "(e.g. 'waiting for a worker: none serves model ...'; GET "
                                                  "/v1/jobs/{id} only)")

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES



# -- events of one job (GET /v1/jobs/{id}/events, Server-Sent Events; dit_serve.server.events) ------------
class ProgressEvent(_Response):
    """The job's progress, sent when it changed (at most every 0.25 s per stream, the latest state)."""

    event: Literal["progress"] = "progress"
    state: State
    counts: dict[str, int] = Field(description="items per state")
    running: int = Field(description="items leased to workers now")
    steps_done: int = Field(description="denoising steps done over all items")
    steps_total: int


class ItemEvent(_Response):
    """One item ended (sent once per ending: an item retried after failing ends again, and is sent again)."""

    event: Literal["item"] = "item"
    index: int
    state: Literal["done", "failed", "cancelled"]
    url: str | None = Field(None, description="done: the image, /v1/jobs/{id}/images/{index} (relative to "
                                              "the service's base URL)")
    error: str | None = Field(None, description="failed: why")
    finished_at: float


class PreviewEvent(_Response):
    """A new preview of a running item (jobs with ``preview_every``): its denoised estimate after ``step``
    steps, small and approximate (no VAE decode). Ephemeral: a reconnect gets the latest, not missed ones."""

    event: Literal["preview"] = "preview"
    index: int
    step: int = Field(description="denoising steps done when it was taken")
    url: str = Field(description="the item's latest preview (PNG), /v1/jobs/{id}/items/{index}/preview (relative "
                                 "to the service's base URL; 404 once the item ended)")


class EndEvent(_Response):
    """The job ended (done, failed or cancelled; deleted: purged while streamed); the stream closes."""

    event: Literal["end"] = "end"
    state: Literal["done", "failed", "cancelled", "deleted"]
    counts: dict[str, int] = Field(default_factory=dict)
    steps_done: int = 0
    steps_total: int = 0
    finished_at: float | None = None
    job: Job | None = Field(None, description="the ended job with its items, as GET /v1/jobs/{id} returns it, "
                                              "for jobs of up to 100 items (null for larger ones)")


JobEvent = Annotated[ProgressEvent | ItemEvent | PreviewEvent | EndEvent, Field(discriminator="event")]


def event_schema() -> dict:
    """JobEvent's JSON schema for OpenAPI: ``schema`` refers to components, ``components`` holds them."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(JobEvent).json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    return {"components": schema.pop("$defs", {}), "schema": schema}


class JobList(_Response):
    data: list[Job]
    total: int
    next_offset: int | None = None


class WorkerStatus(_Response):
    """A worker of the service (its scheduler wrote it to the store within the last 30 s)."""

    name: str = Field(description="worker-<slot>")
    state: Literal["starting", "ready"]
    models: list[str] = Field(description="the models it serves now")
    loading: list[str] = Field(description="the models it loads (a starting worker: those it starts with)")
    held: int = Field(description="items leased to it")
    node: str | None = Field(None, description="the Ray node it runs on (none: a CPU worker anywhere)")
    resource: str | None = Field(None, description="what it takes of its node: GPU, CPU or a custom resource")
    started_at: float


class WorkerList(_Response):
    data: list[WorkerStatus]


# -- OpenAI-compatible images API ----------------------------------------------------------------
class ImageGenerationRequest(_Request):
    """OpenAI's ``POST /v1/images/generations`` body. For class-conditional models the prompt names
    the class (a digit for ``digits``; a class name from ``id2label`` for DiT-XL/2). ``quality``,
    ``style``, ``user``, ``moderation`` and ``safety_identifier`` are accepted and ignored; only PNG,
    opaque, non-streamed output exists; ``seed``, ``steps``, ``guidance`` and ``priority`` are
    extensions (pass them with the OpenAI SDK's ``extra_body``)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT)
    model: str | None = Field(None, min_length=1, max_length=MAX_NAME)
    n: int = Field(1, ge=1, le=10_000)
    size: str | None = Field(None, max_length=20, description="'WxH': one of the model's sizes (GET /v1/models), or any size for "
                                                                 "models with aspect-ratio bins (generated at the "
                                                                 "nearest bin, resized to WxH); 'auto': its native size")
    response_format: Literal["url", "b64_json"] = "url"
    output_format: Literal["png"] | None = None
    output_compression: int | None = Field(None, ge=0, le=100, description="accepted; PNG output is lossless")
    background: Literal["auto", "opaque"] | None = None
    stream: Literal[False] | None = None
    quality: str | None = Field(None, max_length=100)
    style: str | None = Field(None, max_length=100)
    user: str | None = Field(None, max_length=1000)
    moderation: str | None = Field(None, max_length=100)
    safety_identifier: str | None = Field(None, max_length=1000)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="image i uses seed + i; random when omitted")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    guidance: float | None = Field(None, ge=0, le=MAX_GUIDANCE)
    priority: int = Field(0, ge=-100, le=100, description="as for jobs: higher runs first")
    loras: list[LoraRef] | None = Loras


class ImageEditRequest(_Request):
    """The text fields of OpenAI's ``POST /v1/images/edits`` (multipart/form-data; the files are ``image``, one or
    several (``image[]``: a model's reference images, at most its ``max_images``), and ``mask``). As for
    generations: ``prompt`` is the prompt of a text model or names the class of a class model; ``quality``,
    ``user``, ``input_fidelity`` and the like are accepted and ignored; ``seed``, ``steps``, ``guidance``,
    ``strength`` and ``priority`` are extensions (the OpenAI SDK's ``extra_body``)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT)
    model: str | None = Field(None, min_length=1, max_length=MAX_NAME)
    n: int = Field(1, ge=1, le=10_000)
    size: str | None = Field(None, max_length=20, description="'WxH' of the returned images: a size the model "
                                                                 "makes; 'auto' (or none): the model's listed size "
                                                                 "nearest the input image's aspect ratio")
    response_format: Literal["url", "b64_json"] = "url"
    output_format: Literal["png"] | None = None
    output_compression: int | None = Field(None, ge=0, le=100, description="accepted; PNG output is lossless")
    background: Literal["auto", "opaque"] | None = None
    stream: Literal[False] | None = None
    partial_images: Literal[0] | None = None
    quality: str | None = Field(None, max_length=100)
    input_fidelity: str | None = Field(None, max_length=100)
    user: str | None = Field(None, max_length=1000)
    moderation: str | None = Field(None, max_length=100)
    safety_identifier: str | None = Field(None, max_length=1000)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="image i uses seed + i; random when omitted")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    guidance: float | None = Field(None, ge=0, le=MAX_GUIDANCE)
    strength: float | None = Field(None, gt=0, le=1, description="how much of the schedule runs, in (0, 1]; "
                                                                 "default 1.0 with a mask, 0.6 without")
    priority: int = Field(0, ge=-100, le=100, description="as for jobs: higher runs first")
    loras: list[LoraRef] | None = Field(None, min_length=1, max_length=MAX_LORAS,
                                        description="adapters, as for jobs; in a form, the list as JSON text")

    @field_validator("loras", mode="before")
    @classmethod
    def _loras_text(cls, v):  # a form field is text: the list as JSON
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError:
                raise ValueError("loras is a JSON list of {\"name\": ..., \"scale\": ...}") from None
        return v


class Lora(_Response):
    """A registered adapter (POST /v1/loras, or a file of [workers] lora_dir)."""

    name: str
    object: Literal["lora"] = "lora"
    model: str = Field(description="the model it was checked against; jobs of that model may name it (\"\": "
                                   "any served model of its family)")
    family: str = Field(description="that model's family (\"\": any)")
    format: str = Field(description="peft (diffusers' keys), kohya-flux or kohya-sd3")
    rank: int
    modules: int = Field(description="linear layers it adapts")
    sha256: str
    bytes: int
    owner: str = Field(description="the tenant that registered it")
    shared: bool = Field(description="every tenant may use it (registered with the admin key, or from lora_dir)")
    source: Literal["upload", "dir"] = "upload"
    created_at: float


class LoraList(_Response):
    object: Literal["list"] = "list"
    data: list[Lora]


class Upload(_Response):
    """An uploaded image (POST /v1/uploads): jobs name it by ``id`` as their ``image`` or ``mask``."""

    id: str = Field(description="'upl_' and 24 hex digits")
    object: Literal["upload"] = "upload"
    sha256: str = Field(description="SHA-256 of the file's bytes, hex")
    bytes: int = Field(description="the file's size")
    format: Literal["PNG", "JPEG", "WEBP"]
    width: int = Field(description="pixels, upright (EXIF orientation applied)")
    height: int
    filename: str | None = Field(None, description="the name it was uploaded under")
    created_at: float
    expires_at: float | None = Field(None, description="when retention deletes it (null: kept until deleted)")


class ImageData(_Response):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(_Response):
    created: int
    data: list[ImageData]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "dit-serve"
    conditioning: Literal["class", "text"] = Field("class", description="labels or prompts")
    family: str = "dit"
    speed: Literal["default", "fast", "fastest"] = Field("default", description="how fast the workers run it "
                                                         "([workers] speed / model_speed)")
    num_classes: int = 0
    max_tokens: int = Field(0, description="text models: prompts are truncated to this many tokens")
    max_prompt_chars: int = Field(MAX_PROMPT, description="the longest prompt a request may send, in characters "
                                                          "(/v1/jobs and /v1/images/generations alike)")
    image_size: int
    sizes: list[str] = Field(default_factory=list, description="'WxH' sizes the model lists (its native size "
                                                               "first); other sizes snap to the nearest ratio")
    size_multiple: int = Field(1, description="pixels per transformer patch")
    size_range: list[int] = Field(default_factory=list, description="[min, max] px per side: the model also makes "
                                                                    "any size whose sides are multiples of "
                                                                    "size_multiple in this range, as asked; empty: "
                                                                    "only `sizes`")
    class_names: list[str] = Field(default_factory=list, description="index i names class i; empty if unnamed")
    takes_image: bool = Field(False, description="edits: jobs may send an input image and a strength "
                                                 "(image-to-image; POST /v1/images/edits)")
    takes_mask: bool = Field(False, description="inpainting: jobs may send a mask with the image")
    edit: Literal["", "image-to-image", "reference"] = Field(
        "", description="what an input image means: \"image-to-image\" (varied at a strength; inpainted with a "
                        "mask), \"reference\" (an instruction edit, FLUX.1 Kontext, Qwen-Image-Edit: the prompt says "
                        "what to change in the image; no strength, no mask), \"\" (the model takes none)")
    needs_image: bool = Field(False, description="an instruction edit that runs only with an input image "
                                                 "(Qwen-Image-Edit): a job without one is refused")
    max_images: int = Field(1, description="the most input images a job may send: an instruction edit's reference "
                                           "images (Qwen-Image-Edit-Plus: 3, e.g. \"the person of image 1 in the "
                                           "scene of image 2\"); 1 for the others")
    defaults: dict = Field(default_factory=dict)
    samplers: list[str] = Field(default_factory=list, description="the samplers a job may name for this model "
                                                                   "(those that integrate what it predicts)")
    guidance: Literal["cfg", "embedded", "none"] = Field(
        "cfg", description="what a job's `guidance` means: cfg (classifier-free guidance against the negative "
                           "prompt or the null class), embedded (an input of a guidance-distilled network, e.g. "
                           "FLUX.1-dev: no negative prompt), none (ignored, e.g. FLUX.1-schnell)")
    warnings: list[str] = Field(default_factory=list, description="how the model is served differently from its "
                                                                   "reference, e.g. an image-editing model served "
                                                                   "as text-to-image; each job repeats them")


class ManifestImage(_Response):
    file: str = Field(description="the PNG's name beside manifest.json")
    index: int = Field(description="the item's place in its job")
    label: int | None = Field(None, description="class models: the class")
    prompt: str | None = Field(None, description="text models: the prompt")
    seed: int
    state: State = "done"
    error: str | None = Field(None, description="a failed item's reason (the archive lists every item)")

    @classmethod
    def of(cls, file: str, item: ItemStatus) -> "ManifestImage":
        """A job's item as a manifest lists it: a label for class models, a prompt for text models."""
        return cls(file=file, index=item.index, label=item.label if item.prompt is None else None,
                   prompt=item.prompt, seed=item.seed, state=item.state, error=item.error)


class Manifest(_Response):
    """manifest.json, one schema for every writer: `dit-serve generate`, `demo`, `submit --out`, `fetch` and a
    job's archive (GET /v1/jobs/{id}/archive)."""

    job: str | None = Field(description="the service's job id; null for `dit-serve generate` (no service)")
    model: str
    state: State
    params: JobParams | None = Field(description="the job's settings and warnings; null for a stored job that "
                                                 "cannot be read")
    grid: str | None = Field(description="grid.png beside it; null in the archive (it holds no grid)")
    images: list[ManifestImage]

    def dumps(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """Every 4xx/5xx body: OpenAI's error shape, so OpenAI clients show the message."""

    error: ErrorDetail


class Health(_Response):
    status: Literal["ok", "degraded"]
    queue_depth: int
    running: int = Field(0, description="items leased to workers (read with queue_depth, in one query)")
    workers: int | None = Field(None, description="ready workers (None when this process runs no scheduler)")
