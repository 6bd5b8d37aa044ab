#!/bin/bash
# The GPU decode stage on a lent 16-core GPU box, in one command of about 8 minutes: a probe of
# nvImageCodec's CUDA decode, the `cuda`-marked tests, then `python -m bench.gpu_decode` without
# and with the ResNet-18 step (default / CPU only / GPU only / DataLoader(16), the same transform).
#
# Here, on the 2-core machine, once (downloads the wheels the box lacks into .gpu16/, adds the
# test photos; neither step is needed again while .gpu16/ is there):
#   bash ../shared/gpu16/prepare.sh --gpu-decode && bash bench/gpu16.sh --prepare
# Then with the device tool, from the repository root, carrying .gpu16 (about 35 MB):
#   run(command="bash bench/gpu16.sh", carry=[".gpu16"], timeout_s=540)  # the steps end by 7.5 min
# Everything lands in $OUT/gpu16-<date>/ as it is written (bench/results/ without $OUT), so a call
# cut short at its limit still brings back what the finished steps wrote: copy it into
# bench/results/ here and commit it. Each step has its own time limit and the next one runs
# whatever the last did; steps.txt says how each ended. The limits add up to 7.5 minutes with
# their grace (the call must stay within 8, leaving device time for a rerun). SAMPLES (default
# 8192 an epoch) and ROUNDS (3) size the bench.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then  # the photos the tests decode, from this venv's packages
  mkdir -p .gpu16/photos
  exclude=$(git rev-parse --git-path info/exclude)  # a worktree's too (its .git is a file)
  mkdir -p "$(dirname "$exclude")" && { grep -qx '/.gpu16/' "$exclude" 2>/dev/null || echo '/.gpu16/' >> "$exclude"; }
  python - <<'EOF'
import shutil
from pathlib import Path

import matplotlib
import sklearn.datasets

images = Path(sklearn.datasets.__file__).parent / "images"
shutil.copy(images / "china.jpg", ".gpu16/photos/china.jpg")
shutil.copy(images / "flower.jpg", ".gpu16/photos/flower.jpg")
shutil.copy(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg", ".gpu16/photos/grace_hopper.jpg")
EOF
  ls -l .gpu16/photos
  exit 0
fi

[[ -d .gpu16/whl ]] || { echo "no .gpu16/whl: run prepare.sh --gpu-decode and bench/gpu16.sh --prepare here first, then carry .gpu16"; exit 2; }
results="${OUT:-bench/results}/gpu16-$(date -u +%Y-%m-%d-%H%M)"  # straight into $OUT: nothing is lost at a timeout
mkdir -p "$results"
steps="$results/steps.txt"
step() {  # step NAME SECONDS COMMAND...: runs it under a time limit, its output in NAME.log
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  timeout --kill-after=5 "$limit" "$@" > "$results/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - started)) s (limit $limit s)" | tee -a "$steps"
  tail -n 25 "$results/$name.log"
}

python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu16/whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
# nvImageCodec's nvJPEG extension looks for libnvjpeg beside it and in a few fixed folders: the
# nvidia-nvjpeg wheel's lib folder is put on the loader's path wherever it landed
for lib in $(find /tmp/site -name 'libnvjpeg.so*' -printf '%h\n' 2>/dev/null | sort -u); do
  export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
[[ -d .gpu16/photos ]] && export ASYNCLOAD_TEST_PHOTOS="$PWD/.gpu16/photos"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$results/machine.txt" 2>&1

step probe 45 python3 - <<'EOF'
# nvImageCodec's CUDA decode, alone and in the stage: does nvJPEG load, does a region decode on
# the GPU, what falls back and why (a None here: the nvJPEG extension did not load)
import io
import time

import numpy as np
import simplejpeg
from PIL import Image
import torch
from nvidia import nvimgcodec

from asyncload.decode.gpu import GpuImageDecoder
from asyncload.decode.nvimgcodec import RegionDecoder

print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("nvimgcodec", nvimgcodec.__version__, "for CUDA", getattr(nvimgcodec, "__cuda_version__", "?"))
y, x = np.mgrid[0:480, 0:640]
image = np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 127 // 1120], -1).astype(np.uint8)
jpeg = simplejpeg.encode_jpeg(image, quality=90)
buffer = io.BytesIO()
Image.fromarray(image).save(buffer, "JPEG", quality=90, progressive=True)
progressive = buffer.getvalue()
decode = RegionDecoder(torch.device("cuda"))
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    out = decode([jpeg, progressive], [(10, 20, 100, 200), None], stream)
stream.synchronize()
for name, tensor in zip(("baseline ROI", "progressive whole"), out):
    print(name, None if tensor is None else (tuple(tensor.shape), tensor.device, float(tensor.float().mean())))
if out[0] is not None:
    expected = torch.from_numpy(image[10:110, 20:220]).permute(2, 0, 1).float()
    print("ROI mean level difference vs the source", float((out[0].cpu().float() - expected).abs().mean()))
# an RGB-coded JPEG (Adobe APP14 transform 0, no JFIF): the stage refuses it from its header;
# this says whether nvJPEG itself would get its colours right (a large difference: it would not)
import struct
app14 = b"\xff\xee" + struct.pack(">H", 14) + b"Adobe" + struct.pack(">HHHB", 100, 0, 0, 0)
rgb = jpeg[:2] + app14 + jpeg[4 + struct.unpack(">H", jpeg[4:6])[0]:] if jpeg[2:4] == b"\xff\xe0" else None
if rgb is not None:
    with torch.cuda.stream(stream):
        decoded = decode([rgb], [None], stream)[0]
    stream.synchronize()
    expected = torch.from_numpy(simplejpeg.decode_jpeg(rgb)).permute(2, 0, 1).float()
    print("RGB-coded JPEG on the GPU:", None if decoded is None else
          f"mean level difference vs libjpeg {float((decoded.cpu().float() - expected).abs().mean()):.2f}")
stage = GpuImageDecoder(224, train=True)
rows = torch.zeros((64, 224, 224, 3), dtype=torch.uint8, device="cuda")
stream.wait_stream(torch.cuda.current_stream())  # the zeros are written before the stage's rows
for attempt in range(3):
    started = time.perf_counter()
    result = stage.decode_batch([jpeg] * 64, [(0, index) for index in range(64)], rows, stream=stream)
    stream.synchronize()
    print(f"stage, 64 rows: {time.perf_counter() - started:.3f} s, failures {result.failures}, "
          f"on the CPU {result.on_cpu} {result.why}")
EOF

step tests 90 python3 -m pytest -m cuda -o addopts= -p no:cacheprovider -rs -q \
  tests/test_gpu_decode.py tests/test_gpu_stage.py tests/test_batched_decode.py
samples=${SAMPLES:-8192}
rounds=${ROUNDS:-3}
step bench_no_model 150 python3 -m bench.gpu_decode --no-model --samples "$samples" --rounds "$rounds" \
  --out "$results/gpu-decode-no-model.json"
step bench_resnet18 150 python3 -m bench.gpu_decode --model-only --samples "$samples" --rounds "$rounds" \
  --out "$results/gpu-decode-resnet18.json"
cat "$steps"
