"""--device cuda: an end-to-end training loop, so that the host-to-device copy shows.

The batches stay uint8 NHWC until they are on the GPU, where they become float NCHW (4x less PCIe
traffic than converting on the CPU). A small conv net keeps the step short enough that a loader
which does not overlap its copies with compute is visibly slower per step.
"""

from __future__ import annotations

from typing import Any, Callable

from bench.harness.workloads import Workload, image_set


def train_workload(quick: bool) -> Workload:
    spec = image_set(quick)
    return Workload("train", "GPU training loop: small conv net on local ImageNet-like JPEGs",
                    "local", spec.name, 64 if quick else 256, spec.count, 2 if quick else 3,
                    budget_s=5 if quick else 15,
                    note="step time is in s/batch; the consumer holds the GPU, so wait = data stall")


def small_convnet(classes: int):
    import torch.nn as nn

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    return nn.Sequential(block(3, 32), block(32, 64), block(64, 128), block(128, 256),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, classes))


def gpu_consumer(workload: Workload, classes: int = 1000) -> Callable[[Any], int]:
    """A training step per batch; returns the batch size. Works whether the loader hands over
    CPU tensors (copied here, non-blocking from pinned memory) or CUDA tensors (asyncload with
    device="cuda", already copied on its side stream)."""
    import torch
    import torch.nn.functional as F

    device = torch.device("cuda")
    model = small_convnet(classes).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    def step(batch: Any) -> int:
        images, labels = batch
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        x = images.permute(0, 3, 1, 2).float().sub_(mean).div_(std)  # NHWC uint8 -> NCHW float
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()  # as a training loop that logs its loss: the step really ends here
        return int(images.shape[0])

    return step
