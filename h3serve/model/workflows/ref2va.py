"""ref2va: image, video and audio references to video + audio, on the `transformer_ref` partition.

References keep request order, which is the order the model reads them. The prompt names them per
kind ("<Picture i>", "<Video k>", "<Audio j>"); a video with sound also takes the next "<Audio j>",
before its "<Video k>". Each has its own geometry, independent of the requested canvas: an image is
upscaled to its own short edge (2048 released, no area cap), a video goes to 24 fps on the canvas of
its own aspect ratio, cut to the generated length and snapped down to 17n+5 frames, and a soundtrack
costs 40 rows per second and channel.
"""

from __future__ import annotations

from typing import Any

from h3serve.model import rules
from h3serve.model.rules import Geometry, InvalidRequest, Rows
from h3serve.model.workflows.base import (
    WITH_MEDIA_PLAN,
    AssetLookup,
    MediaError,
    ModelDims,
    PreparedMedia,
    TextCounter,
    Workflow,
    check_shape,
    find_asset,
    kind_name,
    numbered,
)
from h3serve.v1 import common_pb2, dit_pb2, gateway_pb2, media_pb2

IMAGE, VIDEO, AUDIO = media_pb2.ASSET_KIND_IMAGE, media_pb2.ASSET_KIND_VIDEO, media_pb2.ASSET_KIND_AUDIO
MAX_PER_KIND = {IMAGE: 9, VIDEO: 3, AUDIO: 3}  # diffusers' Ref2VA set-up block limits
MAX_REFERENCES = 12
LABELS = {IMAGE: "Picture", VIDEO: "Video"}


class REF2VA(Workflow):
    name = "ref2va"
    value = common_pb2.WORKFLOW_REF2VA
    partition = "transformer_ref"
    media_fields = ("references",)
    plan = WITH_MEDIA_PLAN

    def resolve_media(self, request, resolved, assets: AssetLookup, geometry: Geometry) -> None:
        if not request.references:
            raise InvalidRequest("references", "ref2va needs at least one reference")
        if len(request.references) > MAX_REFERENCES:
            raise InvalidRequest("references", f"{len(request.references)} references; at most {MAX_REFERENCES} in all")
        counts, sounds = dict.fromkeys(MAX_PER_KIND, 0), 0
        for index, given in enumerate(request.references):
            name = f"references[{index}]"
            asset = find_asset(assets, name, given.asset_id)
            if given.kind and given.kind != asset.kind:
                raise InvalidRequest(
                    name, f"asset {given.asset_id!r} holds {kind_name(asset.kind)}, not {kind_name(given.kind)}"
                )
            counts[asset.kind] += 1
            if counts[asset.kind] > MAX_PER_KIND[asset.kind]:
                raise InvalidRequest(
                    name,
                    f"a {_ordinal(counts[asset.kind])} {kind_name(asset.kind)} reference; at "
                    f"most {MAX_PER_KIND[asset.kind]} {kind_name(asset.kind)} references",
                )
            _check_reference(name, asset, resolved.num_frames)
            labels = []
            if asset.has_audio:
                sounds += 1
                labels.append(f"<Audio {sounds}>")
            if asset.kind in LABELS:
                labels.append(f"<{LABELS[asset.kind]} {counts[asset.kind]}>")
            resolved.references.add(
                asset_id=asset.asset_id, kind=asset.kind, has_audio=asset.has_audio, label=" ".join(labels)
            )
        if counts[IMAGE] + counts[VIDEO] == 0:
            raise InvalidRequest("references", "audio references need at least one image or video reference with them")

    def label_counts(self, resolved) -> dict[str, int]:
        return {
            "Picture": sum(r.kind == IMAGE for r in resolved.references),
            "Video": sum(r.kind == VIDEO for r in resolved.references),
            "Audio": sum(r.has_audio for r in resolved.references),
        }

    def condition_rows(self, resolved, assets, geometry: Geometry) -> Rows:
        video = audio = 0
        for reference in resolved.references:
            asset = assets(reference.asset_id)
            if asset.kind == IMAGE:
                video += rules.rows_per_latent_frame(*geometry.image_reference_canvas(asset.width, asset.height))
            elif asset.kind == VIDEO:
                frames = rules.reference_video_frames(asset.num_frames, asset.fps, resolved.num_frames)
                canvas = geometry.canvas_for_aspect(asset.width, asset.height)
                video += rules.latent_frames(rules.snap_down(frames)) * rules.rows_per_latent_frame(*canvas)
            if asset.has_audio:
                audio += rules.soundtrack_rows(asset.audio_samples, asset.sample_rate, resolved.num_frames)
        return Rows(condition_video=video, condition_audio=audio)

    def text_rows(self, resolved, assets, text: TextCounter, geometry: Geometry) -> int:
        rows, counts = 0, {"Picture": 0, "Video": 0, "Audio": 0}
        for reference in resolved.references:
            asset = assets(reference.asset_id)
            if asset.has_audio:
                counts["Audio"] += 1
                rows += text.tokens(f"<Audio {counts['Audio']}>: ")
            if asset.kind == IMAGE:
                counts["Picture"] += 1
                rows += text.picture(counts["Picture"], *geometry.image_reference_canvas(asset.width, asset.height))
            elif asset.kind == VIDEO:
                counts["Video"] += 1
                frames = rules.reference_video_frames(asset.num_frames, asset.fps, resolved.num_frames)
                rows += text.video(
                    counts["Video"],
                    rules.sampled_frames(frames),
                    *geometry.canvas_for_aspect(asset.width, asset.height),
                )
        return rows + text.tokens(resolved.prompt)

    def media_items(self, resolved, assets) -> list[media_pb2.MediaItem]:
        return [
            media_pb2.MediaItem(
                asset_id=r.asset_id, kind=r.kind, role=media_pb2.MEDIA_ROLE_REFERENCE, bytes=assets(r.asset_id).bytes
            )
            for r in resolved.references
        ]

    def check_items(self, items) -> None:
        if any(item.role != media_pb2.MEDIA_ROLE_REFERENCE for item in items):
            raise MediaError("items: every ref2va asset has the role MEDIA_ROLE_REFERENCE")
        problem = _kinds_problem([item.kind for item in items])
        if problem:
            raise MediaError(f"items: {problem}")

    def setup_block(self):
        from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

        return MiniMaxH3Ref2VASetupStep()

    def prepare_media(self, pipe, spec, items, decoded) -> PreparedMedia:
        out = pipe(
            references=decoded,
            height=spec.height,
            width=spec.width,
            num_frames=spec.num_frames,
            output=["normalized_references"],
        )
        normalized = out["normalized_references"]
        manifest = [
            media_pb2.ReferenceEntry(
                kind=media_pb2.AssetKind.Value(f"ASSET_KIND_{r.kind.upper()}"), has_audio=r.has_audio
            )
            for r in normalized
        ]
        return PreparedMedia({"normalized_references": normalized}, normalized, {"references": manifest})

    def text_encoder_block(self):
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

        return MiniMaxH3Ref2VATextEncoderStep()

    def vae_encoder_block(self):
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep

        return MiniMaxH3Ref2VAReferenceEncoderStep()

    def encode_condition(self, pipe, item) -> tuple[list, list]:
        out = pipe(normalized_references=[item], output=["condition_latents", "audio_condition_latents"])
        return out["condition_latents"], out["audio_condition_latents"]

    def core_denoise_step(self):
        from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Ref2VACoreDenoiseStep

        return MiniMaxH3Ref2VACoreDenoiseStep()

    def tensor_names(self, spec: dit_pb2.DenoiseSpec) -> tuple[str, ...]:
        visual = sum(r.kind != AUDIO for r in spec.references)
        audio = sum(r.has_audio for r in spec.references)
        return (
            *super().tensor_names(spec),
            *(f"condition_latents.{i}" for i in range(visual)),
            *(f"audio_condition_latents.{j}" for j in range(audio)),
        )

    def check_manifest(self, spec) -> None:
        if spec.keyframe_anchors:
            raise ValueError("keyframe_anchors: ref2va takes references, not keyframe anchors")
        if not spec.references:
            raise ValueError("references: ref2va needs at least one reference")
        problem = _kinds_problem([entry.kind for entry in spec.references])
        if problem:
            raise ValueError(f"references: {problem}")
        for index, entry in enumerate(spec.references):
            if entry.kind == IMAGE and entry.has_audio:
                raise ValueError(f"references[{index}]: an image reference has no audio; clear has_audio")
            if entry.kind == AUDIO and not entry.has_audio:
                raise ValueError(f"references[{index}]: an audio reference is its audio; set has_audio")

    def check_conditioning(self, spec, shapes, dims: ModelDims, geometry: Geometry) -> None:
        """Each image or video reference is latent frames of a canvas of its own, each soundtrack rows of both
        channels, all within what the deployment's geometry and the generated length allow."""
        visual = audio = 0
        for entry in spec.references:
            if entry.kind != AUDIO:
                name, visual = f"condition_latents.{visual}", visual + 1
                _check_reference_latents(name, shapes[name], entry.kind == IMAGE, spec.num_frames, dims, geometry)
            if entry.has_audio:
                name, audio = f"audio_condition_latents.{audio}", audio + 1
                check_shape(name, shapes[name], (None, dims.audio_latent_channels))
                rows, most = shapes[name][0], rules.max_soundtrack_rows(spec.num_frames)
                if rows % rules.AUDIO_CHANNELS or rows > most:
                    raise InvalidRequest(
                        name,
                        f"{rows} rows; a soundtrack takes an even number of rows (both "
                        f"channels), at most {most} for {spec.num_frames} frames",
                    )

    def denoise_inputs(self, spec, tensors) -> dict:
        self.check_manifest(spec)
        return {
            "normalized_references": [_stand_in(entry) for entry in spec.references],
            "condition_latents": numbered(tensors, "condition_latents"),
            "audio_condition_latents": numbered(tensors, "audio_condition_latents"),
        }

    def pipeline_inputs(self, media: dict[str, list]) -> dict:
        return {"references": media.get("references", [])}


def _check_reference(name: str, asset: gateway_pb2.Asset, num_frames: int) -> None:
    if asset.kind in LABELS and not rules.aspect_ok(asset.width, asset.height):
        raise InvalidRequest(
            name,
            f"aspect ratio must be within 1:{rules.MAX_ASPECT} and {rules.MAX_ASPECT}:1, "
            f"got {asset.width}x{asset.height}",
        )
    if asset.kind == VIDEO:
        frames = rules.reference_video_frames(asset.num_frames, asset.fps, num_frames)
        if frames < rules.MIN_REFERENCE_FRAMES:
            raise InvalidRequest(
                name,
                f"a video reference needs at least {rules.MIN_REFERENCE_FRAMES} frames at "
                f"{rules.FPS} fps (17n+5, n >= 1), got {frames}",
            )


def _kinds_problem(kinds: list[int]) -> str | None:
    """Why references of these kinds cannot go together, or None: diffusers' set-up block limits."""
    if not kinds:
        return "at least one reference"
    unknown = [kind for kind in kinds if kind not in MAX_PER_KIND]
    if unknown:
        return f"asset kind {unknown[0]}; references are images, videos or audio"
    if len(kinds) > MAX_REFERENCES:
        return f"{len(kinds)} references; at most {MAX_REFERENCES} in all"
    for kind, most in MAX_PER_KIND.items():
        if kinds.count(kind) > most:
            return f"{kinds.count(kind)} {kind_name(kind)} references; at most {most}"
    if set(kinds) == {AUDIO}:
        return "audio references need at least one image or video reference with them"
    return None


def _check_reference_latents(
    name: str, shape: tuple[int, ...], image: bool, num_frames: int, dims: ModelDims, geometry: Geometry
) -> None:
    """One latent frame of an image, or 5n+2 of a video no longer than the generated one; whole 2x2 patches of a
    canvas within the geometry's reference sizes."""
    check_shape(name, shape, (1, dims.latent_channels, None, None, None))
    frames, height, width = shape[2:]
    if image and frames != 1:
        raise InvalidRequest(name, f"{frames} latent frames; an image reference is one")
    if not image and (
        frames % rules.LATENTS_PER_CHUNK != 2
        or frames < rules.LATENTS_PER_CHUNK + 2
        or rules.pixel_frames(frames) > num_frames
    ):
        raise InvalidRequest(
            name,
            f"{frames} latent frames; a video reference is 5n+2 (n >= 1), at most "
            f"{rules.latent_frames(num_frames)} for {num_frames} frames",
        )
    if height % rules.PATCH or width % rules.PATCH:
        raise InvalidRequest(name, f"latent canvas {height}x{width}; each side a multiple of {rules.PATCH}")
    short, long = (side // rules.VAE_SPATIAL_RATIO for side in geometry.largest_reference_sides(image))
    if min(height, width) > short or max(height, width) > long:
        raise InvalidRequest(
            name,
            f"latent canvas {height}x{width}; at most {short} on the short side and {long} "
            f"on the long one for {'an image' if image else 'a video'} reference here",
        )


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _stand_in(entry: media_pb2.ReferenceEntry):
    """A reference without media: what the ref2va layout reads of it is its kind and whether it has audio."""
    import torch
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    absent: Any = None  # no media to hold: the layout never reads it (were it read, None would fail loudly)
    if entry.kind == IMAGE:
        return MiniMaxH3ImageReference(image=absent)
    if entry.kind == VIDEO:
        return MiniMaxH3VideoReference(frames=absent, audio=torch.empty(0) if entry.has_audio else None)
    return MiniMaxH3AudioReference(audio=torch.empty(0))
