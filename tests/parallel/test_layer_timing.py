"""LayerTimer hooks record forward time per layer kind in a real model."""

import pytest

from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.parallel.cost_model import LayerCosts
from epas_megatron.parallel.layer_timing import LayerTimer, calibrated_costs
from epas_testing import build


@pytest.fixture(scope="module")
def single_process():
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    yield init_distributed(1, 1, None, seed=0)
    destroy_distributed()


class TickClock:
    """A synchronous clock (seconds) that only the model's own modules advance."""

    synchronous = True

    def __init__(self):
        self.now = 0.0

    def start(self):
        return self.now

    def stop(self, started):
        return started, self.now

    def collect(self, pending, wait):
        return [end - start for start, end in pending], []


def test_timer_records_each_layer_kind_of_a_real_model(single_process):
    """Forward hooks on a real model's layers: inside each layer's MLP (and the LM head) the
    clock advances by a known cost per kind (computing 3 ms, sharing 2 ms, LM head 5 ms), so the
    timer must report exactly those times, and count each layer kind per forward; the FLOPs
    costs take the measured ones and the unmeasured embedding scales by their ratio."""
    import torch

    model = build(LlamaArchitecture(4, 64, 4, 2, 176, 256, 32), (2, 3))
    clock = TickClock()
    cost = {"compute": 3e-3, "share": 2e-3, "output_layer": 5e-3}

    def advance(seconds):
        def hook(module, args, output):
            clock.now += seconds
        return hook

    for number, layer in enumerate(model.decoder.layers):
        layer.mlp.register_forward_hook(advance(cost["share" if number in (2, 3) else "compute"]))
    model.output_layer.register_forward_hook(advance(cost["output_layer"]))
    timer = LayerTimer(clock)
    timer.attach([model])
    tokens = torch.randint(0, 256, (1, 32))
    for _ in range(3):
        model(tokens, torch.arange(32).unsqueeze(0), None, labels=tokens)
    assert timer.counts == {"compute": 6, "share": 6, "output_layer": 3}
    timer.detach()
    model(tokens, torch.arange(32).unsqueeze(0), None, labels=tokens)
    assert timer.counts["compute"] == 6  # detached: no more records
    assert timer.measured() == pytest.approx(cost)
    costs = calibrated_costs(LayerCosts(10.0, 8.0, 4.0, 5.0), timer)
    # measured 10 ms over FLOPs 23 (the three measured kinds): the embedding's 4 -> 4 * 10e-3 / 23
    assert (costs.compute_layer, costs.share_layer, costs.output_layer) == pytest.approx((3e-3, 2e-3, 5e-3))
    assert costs.embedding == pytest.approx(4.0 * 10e-3 / 23.0)


# ---------------------------------------------------------------------------- the CUDA-event path
class FakeDevice:
    """A device clock (ms) that forwards advance, and how far the device has got through it."""

    def __init__(self):
        self.now = 0.0
        self.done_until = 0.0
        self.created = 0
        self.waits = 0


class FakeEvent:
    """torch.cuda.Event's timing interface over :class:`FakeDevice`."""

    def __init__(self, device):
        self.device, self.time = device, None
        device.created += 1

    def record(self):
        self.time = self.device.now

    def query(self):
        return self.time <= self.device.done_until

    def synchronize(self):
        self.device.waits += 1
        self.device.done_until = max(self.device.done_until, self.time)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time of an event the device has not reached"
        return end.time - self.time


def fake_chunk(device, costs_ms):
    """A chunk of 3 computing layers, 2 sharing layers and an LM head whose forwards take
    ``costs_ms[kind]`` on the fake device."""
    import torch

    class Timed(torch.nn.Module):
        def __init__(self, cost, mode=None):
            super().__init__()
            self.cost, self.epas_mode = cost, mode

        def forward(self, x):
            device.now += self.cost
            return x

    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    modes = ["compute", "compute", "share", "share", "source"]
    chunk.decoder.layers = torch.nn.ModuleList(Timed(costs_ms["share" if m == "share" else "compute"], m) for m in modes)
    chunk.output_layer = Timed(costs_ms["output_layer"])
    chunk.post_process = True

    def run():
        for layer in chunk.decoder.layers:
            layer(0)
            device.now += 0.5  # host-side work between layers: not part of any layer's time
        chunk.output_layer(0)

    return chunk, run


def test_event_clock_never_waits_in_the_hooks_and_reads_device_times(single_process):
    from epas_megatron.parallel.layer_timing import EventClock

    device = FakeDevice()
    chunk, run = fake_chunk(device, {"compute": 3.0, "share": 2.0, "output_layer": 5.0})
    timer = LayerTimer(EventClock(lambda: FakeEvent(device)))
    timer.collect_every = 12  # two forwards' worth of records (6 each)
    timer.attach([chunk])
    for _ in range(3):
        run()
    assert device.waits == 0  # no hook waited for the device
    assert sum(timer.counts.values()) == 0  # the device has finished nothing yet: nothing read
    device.done_until = device.now  # the device catches up ...
    run()  # ... and the next hooks read the finished records without waiting
    assert device.waits == 0 and sum(timer.counts.values()) == 3 * 6
    assert timer.counts == {"compute": 9, "share": 6, "output_layer": 3}
    run()
    timer.detach()
    run()  # detached: not recorded
    measured = timer.measured()  # reads the rest, waiting once
    assert device.waits >= 1 and timer.counts == {"compute": 15, "share": 10, "output_layer": 5}
    assert measured == pytest.approx({"compute": 3e-3, "share": 2e-3, "output_layer": 5e-3})
    # events whose times were read are reused: another round creates none
    created = device.created
    timer.attach([chunk])
    run()
    timer.measured()
    assert device.created == created and timer.counts["output_layer"] == 6


def test_default_clock_is_perf_counter_on_cpu():
    import torch

    from epas_megatron.parallel.layer_timing import EventClock, PerfCounterClock

    expected = EventClock if torch.cuda.is_available() else PerfCounterClock
    assert isinstance(LayerTimer().clock, expected)
