"""SPDL (Meta's Scalable and Performant Data Loading): its own pipeline, with its FFmpeg-based image
decoder, and also with asyncload's ImageDecoder to separate pipeline from decoder.

The recommended shape (its ImageNet example): source -> async/threaded stages with a concurrency
each -> aggregate into batches -> a batch stage that converts frames into one contiguous buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bench.harness import tasks
from bench.harness.contenders.base import Contender, RunData, cores
from bench.harness.workloads import Workload


class _ShuffledSource:
    """Sample indices; each pass (epoch) is a new permutation, as every other contender's.

    SPDL re-iterates a continuous source as soon as the previous pass is drained (so the next
    epoch starts before the user asks for it), hence the pass counts its own epochs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch = 0

    def __iter__(self):
        order = np.random.default_rng([0, self.epoch]).permutation(self.size).tolist()
        self.epoch += 1
        return iter(order)


def _ffmpeg_filter(width: int, height: int, rng: np.random.Generator) -> str:
    """The same random-resized-crop (torchvision parameters) and flip, as an FFmpeg filter graph."""
    from asyncload.decode.image import random_resized_crop_box

    top, left, crop_h, crop_w = random_resized_crop_box(height, width, rng)
    graph = f"crop=w={crop_w}:h={crop_h}:x={left}:y={top},scale=w=224:h=224:flags=bilinear"
    if rng.random() < 0.5:
        graph += ",hflip"
    return graph + ",format=pix_fmts=rgb24"


def _spdl_decode(data: bytes | str) -> Any:
    """Demux + decode + crop/resize/flip in FFmpeg: SPDL's native image path."""
    import spdl.io

    packets = spdl.io.demux_image(data)
    rng = np.random.default_rng()
    return spdl.io.decode_packets(packets, filter_desc=_ffmpeg_filter(packets.width, packets.height, rng))


def _collate_frames(samples: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    import spdl.io

    frames, labels = zip(*samples)
    images = spdl.io.to_torch(spdl.io.convert_frames(list(frames)))
    return images, torch.tensor(labels, dtype=torch.int64)


def _collate_arrays(samples: list[tuple[np.ndarray, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    arrays, labels = zip(*samples)
    return torch.from_numpy(np.stack(arrays)), torch.tensor(labels, dtype=torch.int64)


class _AsyncS3:
    """One async s3fs client per event loop: SPDL awaits coroutine stages on its own loop."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.fs = None

    async def cat(self, url: str) -> bytes:
        if self.fs is None:
            import s3fs

            self.fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **self.options)
            await self.fs.set_session()
        return await self.fs._cat_file(url, **tasks.S3_READ_KWARGS)


class _Loader:
    def __init__(self, workload: Workload, config: dict, data: RunData) -> None:
        from spdl.pipeline import PipelineBuilder

        threads, io = config["num_threads"], config["io_concurrency"]
        size = workload.samples if workload.source == "synthetic" else len(data.items)
        self.source = _ShuffledSource(size)
        builder = PipelineBuilder().add_source(self.source, continuous=True)
        if workload.source == "synthetic":
            builder.pipe(tasks.large_read_async, concurrency=io, output_order="completion")
            builder.pipe(lambda i: (tasks.large_array(i), 0), concurrency=threads)
            builder.aggregate(workload.batch_size)
            builder.pipe(lambda s: _collate_arrays(s)[0])
        else:
            items, options = data.items, data.storage_options
            ffmpeg = config.get("decoder", "ffmpeg") == "ffmpeg"
            decode = _spdl_decode if ffmpeg else tasks.image_decoder()
            if items[0][0].startswith("s3://"):
                s3 = _AsyncS3(options or {})

                async def read(i: int) -> tuple[bytes, int]:
                    return await s3.cat(items[i][0]), items[i][1]

                builder.pipe(read, concurrency=io, output_order="completion")
                builder.pipe(lambda s: (decode(s[0]), s[1]), concurrency=threads)
            else:  # local: read on the decoding thread, as asyncload does; FFmpeg opens the path
                def load(i: int):
                    url, label = items[i]
                    return decode(url if ffmpeg else tasks.read_bytes(url, None)), label

                builder.pipe(load, concurrency=threads)
            builder.aggregate(workload.batch_size)
            builder.pipe(_collate_frames if ffmpeg else _collate_arrays)
        builder.add_sink(config.get("prefetch", 2))
        self.pipeline = builder.build(num_threads=max(threads, 1))
        self.pipeline.start()

    def set_epoch(self, epoch: int) -> None:
        pass  # see _ShuffledSource

    def __iter__(self):
        return iter(self.pipeline.get_iterator(timeout=300))

    def close(self) -> None:
        self.pipeline.stop()


class SPDLContender(Contender):
    name = "spdl"
    skipped = ("python-step",)

    def unavailable(self) -> str | None:
        """SPDL imports without FFmpeg but cannot decode: try a real decode of a tiny JPEG."""
        try:
            import simplejpeg
            import spdl.io
            from spdl.pipeline import PipelineBuilder  # noqa: F401

            jpeg = simplejpeg.encode_jpeg(np.zeros((16, 16, 3), np.uint8))
            spdl.io.decode_packets(spdl.io.demux_image(jpeg))
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {str(error)[:300]}"
        return None

    def configs(self, workload: Workload, quick: bool) -> list[dict]:
        """Its FFmpeg decoder at 2x the core count (1x was slower in every earlier full run);
        in full mode also asyncload's decoder at 2x (the same transform code as every other
        contender, to tell pipeline from decoder)."""
        n = cores()
        io = 64
        own = [{"num_threads": 2 * n, "io_concurrency": io}]
        if quick or workload.source == "synthetic" or workload.name == "consumer-bound":
            return own
        return own + [{"decoder": "ImageDecoder", "num_threads": 2 * n, "io_concurrency": io}]

    def build(self, workload: Workload, config: dict, data: RunData) -> Any:
        return _Loader(workload, config, data)
