"""`metrale generate --image FILE`: images for a LLaVA checkpoint.

The prompt says where each image goes with the placeholder `<image>` (LLaVA's and
transformers' processor convention, e.g. "USER: <image>\\nWhat is this? ASSISTANT:");
a prompt without one gets one `<image>` line per image at its start (with --chat, at the
start of the user message), as llama.cpp's multimodal CLI does. Each placeholder becomes
`num_image_tokens` copies of `image_token_index` (what LlavaProcessor expands it to), and
the number of placeholders must equal the number of --image files.

With --ids the same rule holds in token ids: a lone image token (the `<image>` id, as the
tokenizer gives it) is a placeholder and becomes a span of `num_image_tokens`; spans already
expanded stay as they are; ids with no image token get one span per image first (after a
leading BOS), without the newline a text prompt's `<image>` lines add.

A LLaVA checkpoint run without --image is a text-only run (a legitimate use: the language
model alone); `generate` says so on stderr. A placeholder in the prompt without --image is
refused, as transformers refuses image tokens without pixels.
"""
from __future__ import annotations

from pathlib import Path

IMAGE_PLACEHOLDER = "<image>"


def check_images(source, paths, prompt: str | None) -> None:
    """Before anything loads: --image on a model without a vision tower, or an `<image>`
    placeholder with no --image, is refused by name."""
    from ..errors import InvalidArgument, Unsupported
    meta = source.metadata()
    if paths and meta.vision is None:
        raise Unsupported(f"{source.description}: --image needs a LLaVA (image + text) "
                          f"checkpoint; this is {meta.architecture!r}, a text-only model")
    if not paths and meta.vision is not None and prompt and IMAGE_PLACEHOLDER in prompt:
        n = prompt.count(IMAGE_PLACEHOLDER)
        raise InvalidArgument(f"the prompt holds {n} {IMAGE_PLACEHOLDER} placeholder(s) but "
                              "no --image FILE was given")


def with_placeholders(prompt: str, n_images: int) -> str:
    """`prompt` with one `<image>` line per image in front when it has no placeholder;
    InvalidArgument when its placeholders do not match the images."""
    from ..errors import InvalidArgument
    n = prompt.count(IMAGE_PLACEHOLDER)
    if n == 0:
        return (IMAGE_PLACEHOLDER + "\n") * n_images + prompt
    if n != n_images:
        raise InvalidArgument(f"the prompt holds {n} {IMAGE_PLACEHOLDER} placeholder(s) but "
                              f"{n_images} --image file(s) were given")
    return prompt


def ids_with_image_spans(ids: list[int], n_images: int, meta) -> list[int]:
    """`ids` (--ids) for `n_images` images by the placeholder rule (module docstring): lone
    image tokens expanded to spans, or the spans put first when there are none; a count
    that differs is refused where the prefill checks the spans (engine/multimodal.py)."""
    F, img = meta.vision.num_image_tokens, meta.vision.image_token_index
    if img not in ids:
        at = 1 if ids and meta.bos_token_id is not None and ids[0] == meta.bos_token_id else 0
        return ids[:at] + [img] * (F * n_images) + ids[at:]
    out = []
    for i, t in enumerate(ids):
        lone = t == img and (i == 0 or ids[i - 1] != img) and \
            (i + 1 == len(ids) or ids[i + 1] != img)
        out += [img] * F if lone else [t]
    return out


def chat_text(directory, system: str | None, prompt: str, n_images: int) -> str:
    """The chat template's text for a user `prompt` (and `system`) with `n_images` images.

    Templates take a message's content one of two ways (vLLM's "string" and "openai"
    content formats): as a string, or as a list of parts (`{"type": "image"}`, `{"type":
    "text", "text": ...}`), which LLaVA's templates need (a string renders as nothing
    there). The template is probed once with a string to see which; images go in as
    `<image>` placeholders (string) or image parts first (parts), unless the prompt places
    them itself."""
    from ..engine.chat import apply_chat_template
    from ..errors import InvalidArgument

    def render(system_content, user_content):
        messages = ([{"role": "system", "content": system_content}] if system else []) + \
            [{"role": "user", "content": user_content}]
        return apply_chat_template(directory, messages, tokenize=False)
    probe = "metrale-probe-3f9a"
    if probe in render(system, probe):
        user = with_placeholders(prompt, n_images) if n_images else prompt
        return render(system, user)
    placed = prompt.count(IMAGE_PLACEHOLDER) if n_images else 0
    if placed:
        with_placeholders(prompt, n_images)   # the counts must agree
    parts = [{"type": "image"}] * (n_images if not placed else 0) + \
        [{"type": "text", "text": prompt}]
    text = render([{"type": "text", "text": system}], parts)
    if n_images and text.count(IMAGE_PLACEHOLDER) != n_images:
        raise InvalidArgument(f"the chat template wrote {text.count(IMAGE_PLACEHOLDER)} "
                              f"{IMAGE_PLACEHOLDER} placeholder(s) for {n_images} image(s); "
                              "give a plain prompt with the placeholders instead of --chat")
    return text


def encode_with_images(tok, text: str, vision, add_special_tokens: bool) -> list[int]:
    """Token ids of `text` with every `<image>` expanded to `vision.num_image_tokens`
    copies of `vision.image_token_index`.

    A tokenizer that has `<image>` as the image token (LLaVA checkpoints do) encodes the
    whole text, exactly as LlavaProcessor's expanded string; one without it (a plain text
    tokenizer) encodes the text between placeholders piece by piece, special tokens (BOS)
    only before the first piece."""
    F, img = vision.num_image_tokens, vision.image_token_index
    if tok.token_to_id(IMAGE_PLACEHOLDER) == img:
        ids = tok.encode(text, add_special_tokens=add_special_tokens).ids
        return [t for i in ids for t in ([img] * F if i == img else [i])]
    out: list[int] = []
    pieces = text.split(IMAGE_PLACEHOLDER)
    for i, piece in enumerate(pieces):
        if piece or (i == 0 and add_special_tokens):
            out += tok.encode(piece, add_special_tokens=add_special_tokens and i == 0).ids
        if i < len(pieces) - 1:
            out += [img] * F
    return out


def load_images(source, paths) -> list:
    """Each file (PNG, JPEG, ... through Pillow) preprocessed for the checkpoint's vision
    tower: `[1, 3, H, W]` float32, with its preprocessor_config.json (else CLIP defaults)."""
    from ..vision.preprocess import ImageProcessorConfig, load_image, preprocess_image
    size = source.metadata().vision.image_size
    path = getattr(source, "path", None)
    cfg = ImageProcessorConfig.from_pretrained(path, size) if isinstance(path, Path) else \
        ImageProcessorConfig.clip_defaults(size)
    return [preprocess_image(load_image(p), cfg) for p in paths]
