"""VAE service: latents -> validated video + audio, muxed into an MP4 that is streamed back in chunks."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from h3serve.common.bounds import brief
from h3serve.common.config import VaeConfig
from h3serve.common.server import refuse_port_in_use, run_server
from h3serve.model.workflows.base import MediaError
from h3serve.runtime import fastpath, memory, wire
from h3serve.runtime.checks import check_media_spec, spec_checked
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.media import MediaPreparer, read_media_stream
from h3serve.runtime.offload import HostWhileIdle
from h3serve.runtime.pump import ClientGone, pump
from h3serve.runtime.service import check_host_memory, load_model_service, warm_up
from h3serve.services.vae import checks, mux
from h3serve.services.vae.conditions import ConditionEncoder
from h3serve.services.vae.decode import COMPONENTS, Decoded, DecodePlan, OnPixels, Progress, VaeDecoder
from h3serve.services.vae.tiles import TileDecoder, decode_devices
from h3serve.services.vae.validate import InvalidOutput, validate
from h3serve.v1 import common_pb2, vae_pb2, vae_pb2_grpc

FILE_CHUNK_BYTES = 1 << 20

log = logging.getLogger("h3serve.vae")

Report = Callable[[vae_pb2.DecodeEvent], None]


@dataclass(frozen=True)
class Output:
    video: bytes  # video.mp4
    raw: bytes | None  # raw.npz, when asked for
    summary: vae_pb2.DecodeSummary


def file_events(name: str, data: bytes) -> Iterator[vae_pb2.DecodeEvent]:
    for offset in range(0, len(data), FILE_CHUNK_BYTES):
        piece = data[offset : offset + FILE_CHUNK_BYTES]
        yield vae_pb2.DecodeEvent(file=vae_pb2.FileChunk(name=name, offset=offset, data=piece))


@dataclass(frozen=True)
class Checked:
    """A decode that passed validation."""

    decoded: Decoded  # the float frames and audio, still on the VAE's device
    audio: np.ndarray  # (channels, S) float32, on the CPU


def decode_checked(
    decoder: VaeDecoder,
    latents: torch.Tensor,
    audio_latents: torch.Tensor,
    on_video: Progress,
    on_audio: Progress,
    on_pixels: OnPixels | None = None,
) -> Checked:
    """The service's decode phase: the block (each chunk's uint8 pixels handed to `on_pixels` as it is final)
    and the checks on the VAE's device, then the audio copied to the CPU."""
    decoded = decoder.decode(latents, audio_latents, on_video=on_video, on_audio=on_audio, on_pixels=on_pixels)
    validate(decoded.frames, decoded.audio)
    return Checked(decoded=decoded, audio=decoded.audio.cpu().numpy())


def summarize(checked: Checked, video: bytes, raw: bytes | None) -> vae_pb2.DecodeSummary:
    num_frames, height, width = checked.decoded.frames.shape[:3]
    summary = vae_pb2.DecodeSummary(
        sha256=hashlib.sha256(video).hexdigest(),
        bytes=len(video),
        duration_s=num_frames / mux.FPS,
        num_frames=num_frames,
        height=height,
        width=width,
        fps=mux.FPS,
        sample_rate=checked.decoded.sample_rate,
        audio_channels=checked.audio.shape[0],
    )
    if raw is not None:
        summary.raw_sha256, summary.raw_bytes = hashlib.sha256(raw).hexdigest(), len(raw)
    return summary


def raw_archive(frames: np.ndarray, audio: np.ndarray, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, frames=frames, audio=audio, sample_rate=np.int64(sample_rate))
    return buffer.getvalue()


def phase_reporter(report: Report, phase: vae_pb2.DecodePhase) -> Callable[[int, int], None]:
    """A (done, total) progress callback that reports DecodeProgress events of `phase`."""
    return lambda done, total: report(
        vae_pb2.DecodeEvent(progress=vae_pb2.DecodeProgress(phase=phase, done=done, total=total))
    )


def unless_cancelled(report: Report, context) -> Report:
    """`report`, raising ClientGone once the client has gone, so the decode stops at its next step."""

    def checked(event: vae_pb2.DecodeEvent) -> None:
        if not context.is_active():
            raise ClientGone()
        report(event)

    return checked


class VaeServicer(vae_pb2_grpc.VAEServicer):
    def __init__(
        self,
        decoder: VaeDecoder,
        model: common_pb2.ModelInfo,
        config: VaeConfig,
        idle: HostWhileIdle | None = None,
    ) -> None:
        self.decoder = decoder
        self.device = decoder.vae.device if idle is None else idle.device  # idle, the weights are on the CPU
        # the weights on the GPU for one request (offload = "idle"), else where they always are
        self.on_device: Callable[[], AbstractContextManager] = idle.on_device if idle else contextlib.nullcontext
        self.conditions = ConditionEncoder(decoder.vae, decoder.audio_vae)
        self.media = MediaPreparer(config.geometry)
        self.model = model
        self.config = config
        self.requests_served = 0
        self._lock = threading.Lock()  # one decode at a time: the block is not re-entrant, and frames are large

    def Decode(self, request_iterator, context):
        try:
            with wire.refusal_heard(request_iterator):
                spec, tensors = wire.read_spec_stream(
                    request_iterator, lambda spec: checks.decode_expected(spec, self.decoder, self.config)
                )
            plan = self.decoder.plan(tensors["latents"], tensors["audio_latents"])
            checks.check_plan(plan, tensors["audio_latents"].shape[-1], self.config)
        except ValueError as exc:  # WireError, InvalidLatents, InvalidRequest
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if spec.params.include_raw and plan.raw_bytes > self.config.max_raw_bytes:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"include_raw: the raw output would be {plan.raw_bytes} bytes, "
                f"over the limit of {self.config.max_raw_bytes} bytes (max_raw_bytes)",
            )
        output = yield from self._pumped(
            spec.job_id,
            "decode",
            lambda report: self._run(spec, tensors, plan, unless_cancelled(report, context)),
            context,
            InvalidOutput,
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        if output is None:
            return
        yield from file_events("video.mp4", output.video)
        if output.raw is not None:
            yield from file_events("raw.npz", output.raw)
        yield vae_pb2.DecodeEvent(summary=output.summary)

    def _pumped(self, job_id: str, what: str, work, context, refused: type[Exception], code: grpc.StatusCode):
        """`work` through `pump`; None when the client left. `refused` errors end the RPC with `code`,
        anything else with INTERNAL and the error's type and first line (the log has the traceback)."""
        try:
            return (yield from pump(work))
        except ClientGone:
            log.info("job %s: %s cancelled by the client", job_id, what)
            return None
        except refused as exc:
            context.abort(code, str(exc))
        except Exception as exc:
            log.exception("job %s: %s failed", job_id, what)
            context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {brief(exc)}")
        finally:
            # After every Decode / EncodeConditions (cancelled and failed ones too): the allocator's cache goes
            # back to the driver, so a stage sharing this GPU can use it. Cheap: milliseconds against a decode.
            memory.release(self.device)

    def _run(
        self, spec: vae_pb2.DecodeSpec, tensors: dict[str, torch.Tensor], plan: DecodePlan, report: Report
    ) -> Output:
        latents, audio_latents = tensors["latents"], tensors["audio_latents"]
        muxing = phase_reporter(report, vae_pb2.DECODE_PHASE_MUX)
        with (
            self._lock,
            self.on_device(),
            mux.Muxer(
                plan.frames,
                plan.height,
                plan.width,
                plan.sample_rate,
                plan.audio_channels,
                muxing,
                self.config.x264_preset,
                self.config.x264_threads,
            ) as muxer,
        ):
            started = time.perf_counter()
            checked = decode_checked(
                self.decoder,
                latents,
                audio_latents,
                on_video=phase_reporter(report, vae_pb2.DECODE_PHASE_VIDEO),
                on_audio=phase_reporter(report, vae_pb2.DECODE_PHASE_AUDIO),
                on_pixels=muxer.add,
            )
            decoded_at = time.perf_counter()
            video = muxer.finish(checked.audio)  # the video frames were encoded while the decode ran
            muxed_at = time.perf_counter()
            raw = (
                raw_archive(checked.decoded.frames.cpu().numpy(), checked.audio, plan.sample_rate)
                if spec.params.include_raw
                else None
            )
            self.requests_served += 1
        summary = summarize(checked, video, raw)
        summary.decode_seconds, summary.mux_seconds = decoded_at - started, muxed_at - decoded_at
        log.info(
            "job %s: decoded %d frames of %dx%d in %.2f s, MP4 of %d bytes done %.2f s later",
            spec.job_id,
            summary.num_frames,
            summary.width,
            summary.height,
            summary.decode_seconds,
            summary.bytes,
            summary.mux_seconds,
        )
        return Output(video=video, raw=raw, summary=summary)

    def EncodeConditions(self, request_iterator, context):
        try:
            with wire.refusal_heard(request_iterator):
                spec, assets = read_media_stream(spec_checked(request_iterator, self._check_media))
        except ValueError as exc:  # MediaError included
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        result = yield from self._pumped(
            spec.job_id,
            "condition encode",
            lambda report: self._encode_conditions(spec, assets, unless_cancelled(report, context)),
            context,
            MediaError,
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        if result is None:
            return
        summary, tensors = result
        for chunk in wire.encode_many(tensors):
            yield vae_pb2.ConditionEvent(chunk=chunk)
        yield vae_pb2.ConditionEvent(summary=summary)

    def _check_media(self, spec) -> None:
        check_media_spec(spec, self.config.geometry, self.config.max_input_bytes)

    def _encode_conditions(self, spec, assets, report: Report):
        def progress(done: int, total: int) -> None:
            report(vae_pb2.ConditionEvent(progress=vae_pb2.ConditionProgress(done=done, total=total)))

        with self._lock, self.on_device():
            started = time.perf_counter()
            conditions = self.conditions.encode(spec.workflow, self.media.prepare(spec, assets), progress)
        summary = vae_pb2.ConditionSummary(seconds=time.perf_counter() - started, **conditions.manifest)
        log.info("job %s: encoded %d conditions in %.2f s", spec.job_id, len(assets), summary.seconds)
        return summary, conditions.tensors

    def Info(self, request, context):
        return vae_pb2.VaeInfo(
            model=self.model, requests_served=self.requests_served, max_raw_bytes=self.config.max_raw_bytes
        )


def serve(config: VaeConfig) -> None:
    refuse_port_in_use(config.address)  # before minutes of loading: a restart would not free the port
    try:
        check_host_memory("vae", config)
    except ValueError as exc:
        raise SystemExit(f"h3serve serve vae: {exc}") from None
    components, model = load_model_service("vae", COMPONENTS, config)
    vae = components["vae"]
    tiles = TileDecoder(vae, config.tile_batch, decode_devices(vae.device, config.decode_gpus))
    for replica in tiles.models:
        fastpath.apply(replica, FastPath.of(config))
    decoder = VaeDecoder(vae, components["audio_vae"], tiles.decoders)
    if not config.compile or config.compile_dynamic:  # a static compile would compile a canvas no request has
        warm_up("vae", lambda: decoder.warm_up(config.tile_batch))
    device = vae.device  # offload = "idle" moves the weights to the host: release where they were
    idle = HostWhileIdle([vae, components["audio_vae"]], device) if config.offload == "idle" else None
    memory.release(device)
    servicer = VaeServicer(decoder, model, config, idle)
    run_server(
        lambda server: vae_pb2_grpc.add_VAEServicer_to_server(servicer, server),
        [vae_pb2.DESCRIPTOR.services_by_name["VAE"].full_name],
        config.address,
        tls=(config.tls_cert, config.tls_key),
        auth_token=config.auth_token,
    )
