"""fl2va: a first and/or a last keyframe to video + audio.

A keyframe is an image asset; without an explicit canvas the first given keyframe's aspect ratio decides
it (the model's 768-short-edge rule). Each keyframe is one latent frame of conditioning rows and one
"<Picture i>: " vision block in the text encoder's presentation.
"""

from __future__ import annotations

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

ROLES = {"first_frame": media_pb2.MEDIA_ROLE_FIRST_FRAME, "last_frame": media_pb2.MEDIA_ROLE_LAST_FRAME}
ANCHORS = ("first", "last")


def keyframes(resolved: gateway_pb2.ResolvedRequest) -> list[tuple[str, str]]:
    """(field, asset id) of the keyframes given, first before last (the packed order)."""
    return [(name, getattr(resolved, name)) for name in ROLES if getattr(resolved, name)]


class FL2VA(Workflow):
    name = "fl2va"
    value = common_pb2.WORKFLOW_FL2VA
    media_fields = tuple(ROLES)
    plan = WITH_MEDIA_PLAN

    def resolve_media(self, request, resolved, assets: AssetLookup, geometry: Geometry) -> None:
        given = keyframes(request)
        if not given:
            raise InvalidRequest("first_frame", "fl2va needs a first_frame, a last_frame or both")
        found = []
        for name, asset_id in given:
            asset = find_asset(assets, name, asset_id)
            found.append(asset)
            if asset.kind != media_pb2.ASSET_KIND_IMAGE:
                raise InvalidRequest(name, f"asset {asset_id!r} holds {kind_name(asset.kind)}; keyframes are images")
            if not rules.aspect_ok(asset.width, asset.height):
                raise InvalidRequest(
                    name,
                    f"aspect ratio must be within 1:{rules.MAX_ASPECT} and {rules.MAX_ASPECT}:1, "
                    f"got {asset.width}x{asset.height}",
                )
            setattr(resolved, name, asset_id)
        if not request.height and not request.width:  # the canvas follows the first given keyframe
            anchor = found[0]
            resolved.height, resolved.width = geometry.canvas_for_aspect(anchor.width, anchor.height)

    def label_counts(self, resolved) -> dict[str, int]:
        return {"Picture": len(keyframes(resolved))}

    def condition_rows(self, resolved, assets, geometry) -> Rows:
        return Rows(
            condition_video=len(keyframes(resolved)) * rules.rows_per_latent_frame(resolved.height, resolved.width)
        )

    def text_rows(self, resolved, assets, text: TextCounter, geometry) -> int:
        pictures = sum(
            text.picture(index, resolved.height, resolved.width) for index in range(1, len(keyframes(resolved)) + 1)
        )
        return pictures + text.tokens(resolved.prompt)

    def media_items(self, resolved, assets) -> list[media_pb2.MediaItem]:
        return [
            media_pb2.MediaItem(
                asset_id=asset_id, kind=media_pb2.ASSET_KIND_IMAGE, role=ROLES[name], bytes=assets(asset_id).bytes
            )
            for name, asset_id in keyframes(resolved)
        ]

    def setup_block(self):
        from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep

        return MiniMaxH3ResizeStep()

    def check_items(self, items) -> None:
        roles = [item.role for item in items]
        if (
            not roles
            or len(set(roles)) != len(roles)
            or set(roles) - set(ROLES.values())
            or any(item.kind != media_pb2.ASSET_KIND_IMAGE for item in items)
        ):
            raise MediaError("items: fl2va takes one first and/or one last keyframe, both images")

    def prepare_media(self, pipe, spec, items, decoded) -> PreparedMedia:
        self.check_items(items)
        by_role = {item.role: reference.image for item, reference in zip(items, decoded, strict=True)}
        out = pipe(
            image=by_role.get(ROLES["first_frame"]),
            last_image=by_role.get(ROLES["last_frame"]),
            height=spec.height,
            width=spec.width,
            output=["keyframes", "keyframe_anchors"],
        )
        return PreparedMedia(
            {"keyframes": out["keyframes"]}, out["keyframes"], {"keyframe_anchors": tuple(out["keyframe_anchors"])}
        )

    def text_encoder_block(self):
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

        return MiniMaxH3FL2VATextEncoderStep()

    def vae_encoder_block(self):
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep

        return MiniMaxH3KeyframeVaeEncoderStep()

    def encode_condition(self, pipe, item) -> tuple[list, list]:
        return pipe(keyframes=[item], output="condition_latents"), []

    def core_denoise_step(self):
        from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3FL2VACoreDenoiseStep

        return MiniMaxH3FL2VACoreDenoiseStep()

    def tensor_names(self, spec: dit_pb2.DenoiseSpec) -> tuple[str, ...]:
        return (*super().tensor_names(spec), *(f"condition_latents.{i}" for i in range(len(spec.keyframe_anchors))))

    def check_manifest(self, spec) -> None:
        if spec.references:
            raise ValueError("references: fl2va takes keyframe_anchors, not references")
        anchors = list(spec.keyframe_anchors)
        if (
            not anchors
            or len(anchors) > len(ANCHORS)
            or set(anchors) - set(ANCHORS)
            or len(set(anchors)) != len(anchors)
        ):
            given = [anchor[:16] for anchor in anchors] if len(anchors) <= len(ANCHORS) else f"{len(anchors)} anchors"
            raise ValueError(f"keyframe_anchors: fl2va needs 'first' and/or 'last', got {given}")

    def check_conditioning(self, spec, shapes, dims: ModelDims, geometry) -> None:
        """Each keyframe is one latent frame of the canvas."""
        ratio = rules.VAE_SPATIAL_RATIO
        for name in self.tensor_names(spec)[2:]:
            check_shape(name, shapes[name], (1, dims.latent_channels, 1, spec.height // ratio, spec.width // ratio))

    def denoise_inputs(self, spec, tensors) -> dict:
        self.check_manifest(spec)
        return {
            "keyframe_anchors": tuple(spec.keyframe_anchors),
            "condition_latents": numbered(tensors, "condition_latents"),
        }

    def pipeline_inputs(self, media: dict[str, list]) -> dict:
        names = {"first_frame": "image", "last_frame": "last_image"}
        return {names[name]: decoded[0].image for name, decoded in media.items()}
