"""SplitPolicy: the GPU's share of each batch from fed events (rows and seconds of each side's
calls, the training step's seconds); no thread, no clock."""

import pytest

from asyncload.decode.split import PROBE_EVERY, SplitPolicy


def measured(gpu_rate: float, cpu_rate_per_thread: float, threads: int) -> SplitPolicy:
    policy = SplitPolicy("auto", cpu_threads=threads)
    policy.gpu_done(100, 10.0)  # the warm-up call: not measured
    policy.gpu_done(100, 100 / gpu_rate)
    policy.cpu_done(10, 10 / cpu_rate_per_thread)
    return policy


def test_half_and_half_until_both_rates_are_measured():
    policy = SplitPolicy("auto", cpu_threads=4)
    assert policy.gpu_rows(256) == 128 and "until both rates" in policy.why
    policy.gpu_done(128, 0.1)
    assert policy.gpu_rows(255) == 128


def test_the_split_makes_both_sides_finish_a_batch_at_once():
    policy = measured(gpu_rate=6000, cpu_rate_per_thread=500, threads=4)  # GPU 6,000 rows/s, CPU 2,000
    gpu = policy.gpu_rows(256)
    assert gpu == 192  # 3/4: 192 rows / 6,000 = 64 rows / 2,000
    assert gpu / 6000 == pytest.approx((256 - gpu) / 2000)
    assert "both finish a batch at once" in policy.why
    assert "GPU 6,000 rows/s, CPU 2,000 rows/s (4 threads)" in policy.why


def test_the_rates_are_smoothed_so_one_slow_call_moves_the_split_a_little():
    policy = measured(gpu_rate=6000, cpu_rate_per_thread=500, threads=4)
    policy.gpu_done(100, 100 / 2000)  # one slow GPU call
    assert policy.gpu.value == pytest.approx(0.7 * 6000 + 0.3 * 2000)
    assert 160 < policy.gpu_rows(256) < 192


def test_a_step_slower_than_the_loader_shrinks_the_gpu_share_to_what_the_cpu_cannot_do():
    policy = measured(gpu_rate=6000, cpu_rate_per_thread=500, threads=4)
    policy.step(0.01)  # a fast step: the loader is the limit, the balanced split stands
    assert policy.gpu_rows(256) == 192
    slow = measured(gpu_rate=6000, cpu_rate_per_thread=500, threads=4)
    slow.step(0.1)  # the CPU decodes 2,000 * 0.1 * 0.8 = 160 rows in one step: the GPU takes the rest
    assert slow.gpu_rows(256) == 96 and "the step (100 ms) is slower" in slow.why
    slower = measured(gpu_rate=6000, cpu_rate_per_thread=500, threads=4)
    slower.step(0.5)  # the CPU keeps up alone: the GPU is left to the training step
    assert slower.gpu_rows(256) == 0


def test_when_gpu_decode_slows_the_step_the_share_shrinks_step_after_step():
    policy = measured(gpu_rate=6000, cpu_rate_per_thread=500, threads=4)
    shares = []
    for step_s in (0.05, 0.09, 0.12, 0.15):  # the step slows as the GPU decodes beside it
        policy.step(step_s)
        shares.append(policy.gpu_rows(256))
    assert shares == sorted(shares, reverse=True) and shares[-1] < shares[0]


@pytest.mark.parametrize("mode, expected", [("gpu", 256), ("cpu", 0)])
def test_a_pinned_mode_ignores_the_measurements(mode, expected):
    policy = SplitPolicy(mode, cpu_threads=4)
    policy.gpu_done(100, 1.0)
    policy.cpu_done(100, 0.01)
    policy.step(10.0)
    assert policy.gpu_rows(256) == expected and f"pinned: {mode} only" in policy.describe()


def test_describe_counts_the_rows_each_side_took():
    policy = measured(gpu_rate=6000, cpu_rate_per_thread=500, threads=4)
    policy.gpu_rows(256)
    policy.gpu_rows(256)
    assert policy.rows == {"gpu": 384, "cpu": 128}
    assert policy.describe().startswith("GPU decode (auto): GPU 75 % of 512 rows, CPU the rest; GPU 6,000 rows/s")


def test_bad_mode_and_empty_measurements():
    with pytest.raises(ValueError, match="mode must be 'auto', 'gpu' or 'cpu'"):
        SplitPolicy("half")
    policy = SplitPolicy()
    policy.gpu_done(0, 0.1)
    policy.cpu_done(5, 0.0)
    assert policy.gpu.value is None and policy.cpu.value is None


def test_the_gpu_s_first_call_is_the_warm_up_and_is_not_measured():
    policy = SplitPolicy("auto", cpu_threads=4)
    policy.gpu_done(16, 1.5)  # cold nvJPEG, CUDA modules loaded lazily
    policy.cpu_done(4, 0.016)
    assert policy.gpu.value is None and policy.gpu_rows(32) == 16
    policy.gpu_done(16, 16 / 20000)
    assert policy.gpu.value == 20000


def test_a_gpu_that_decodes_none_of_its_rows_is_measured_at_zero_and_keeps_only_probes():
    """Every row of its calls fell back (nvImageCodec without nvJPEG): a rate of 0, not "not
    measured yet", so the GPU keeps only its probe share instead of half of every batch."""
    policy = SplitPolicy("auto", cpu_threads=4)
    policy.gpu_done(128, 1.0)  # the warm-up
    policy.gpu_done(0, 0.2)
    policy.cpu_done(32, 0.1)
    assert policy.gpu.value == 0.0
    shares = [policy.gpu_rows(256) for _ in range(PROBE_EVERY)]
    assert shares == [0] * (PROBE_EVERY - 1) + [256 // 16], shares
    assert "GPU 0 rows/s" in policy.why
    policy.gpu_done(16, 16 / 8000)  # it decodes again: it wins its share back
    assert policy.gpu.value > 0 and policy.gpu_rows(256) > 0


def feed(policy: SplitPolicy, batches: int, gpu_rate: float, cpu_rate_per_thread: float) -> list[int]:
    """The loader's loop: each side hears of a call only when it was given rows."""
    shares = []
    for _ in range(batches):
        gpu = policy.gpu_rows(32)
        shares.append(gpu)
        if gpu:
            policy.gpu_done(gpu, gpu / gpu_rate)
        if gpu < 32:
            policy.cpu_done(32 - gpu, (32 - gpu) / cpu_rate_per_thread)
    return shares


def test_a_gpu_measured_slow_once_is_probed_and_wins_its_share_back():
    policy = SplitPolicy("auto", cpu_threads=4, cpu_chunk=4)
    policy.gpu_done(16, 1.5)  # warm-up
    policy.gpu_done(16, 1.5)  # still slow: 11 rows/s, its share rounds to 0
    policy.cpu_done(4, 0.016)
    shares = feed(policy, 200, gpu_rate=20000, cpu_rate_per_thread=250)
    assert shares[0] == 0
    assert shares[PROBE_EVERY - 1] == 2  # the probe: 1/16 of the batch
    # 20,000 vs 1,000 rows/s: the GPU takes nearly all again (28 on the CPU's probe batches)
    assert shares[-20:] == [30] * 9 + [28] + [30] * 9 + [28]


def test_a_cpu_measured_slow_once_is_probed_and_wins_its_share_back():
    policy = SplitPolicy("auto", cpu_threads=4, cpu_chunk=4)
    policy.gpu_done(16, 1.0)  # warm-up
    policy.gpu_done(16, 16 / 2000)
    policy.cpu_done(4, 4.0)  # one very slow CPU call: 1 row/s per thread
    shares = feed(policy, 200, gpu_rate=2000, cpu_rate_per_thread=500)
    assert shares[0] == 32
    assert shares[PROBE_EVERY - 1] == 28  # the probe: the CPU's smallest job
    assert max(shares[-20:]) <= 18  # 2,000 vs 2,000 rows/s: about half each again
