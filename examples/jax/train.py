"""Data-parallel JAX on CPU, a program that knows nothing of Phalanx: an MLP on scikit-learn's
bundled digits, hand-written SGD, gradients averaged across processes by a `pmean`.

Under `launcher: plain` every process finds torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, ...) and gives them to `jax.distributed.initialize`; rank 0 runs JAX's coordinator
on MASTER_PORT. Run alone (`python train.py`) it is one process and initializes nothing.
"""

import argparse
import functools
import hashlib
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits


def init_distributed() -> None:
    if "WORLD_SIZE" not in os.environ:
        return  # alone: one process, nothing to join
    # JAX's preemption service catches SIGTERM and lets the program run on; without it a stop
    # (SIGTERM to every rank) ends the processes at once, as it would a torch script.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        num_processes=int(os.environ["WORLD_SIZE"]),
        process_id=int(os.environ["RANK"]),
    )
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        gloo_on_interface(os.environ["GLOO_SOCKET_IFNAME"])


def gloo_on_interface(interface: str) -> None:
    """JAX's gloo listens on the address the host name resolves to, often 127.0.x.1: peers on
    other machines then cannot connect ("Gloo context initialization failed ... Connect
    timeout"). Phalanx sets GLOO_SOCKET_IFNAME to the agent's interface, which torch reads; JAX
    (0.10) has no public option for it, so the CPU backend is rebuilt with gloo on that interface
    (before anything touches a device)."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    client = distributed.global_state.client
    collectives = _jax.make_gloo_tcp_collectives(distributed_client=client, interface=interface)
    factory = functools.partial(xla_bridge.make_cpu_client, collectives)
    xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


def init_params(sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """He-initialised weights, zero biases, from a fixed seed: the same on every process."""
    rng = np.random.default_rng(0)
    return [
        ((rng.standard_normal((m, n)) * np.sqrt(2.0 / m)).astype(np.float32), np.zeros(n, np.float32))
        for m, n in itertools.pairwise(sizes)
    ]


def forward(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss_fn(params: list[tuple[jax.Array, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    logits = forward(params, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def checksum(params: list[tuple[jax.Array, jax.Array]]) -> str:
    """sha256 of this process's copy of the parameters: equal on every process when the
    gradients really were averaged (each process sees a different shard of every batch)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf.addressable_data(0), np.float32).tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64, help="global: split across the processes")
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()

    init_distributed()
    rank, world = jax.process_index(), jax.process_count()
    print(f"jax process {rank}/{world} devices {jax.local_devices()}", flush=True)
    if args.batch_size % jax.device_count():
        raise SystemExit(f"--batch-size {args.batch_size} does not split over {jax.device_count()} devices")

    # One mesh axis over every process's devices: parameters replicated, batches split along it.
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x_all, y_all = (digits.data[order] / 16.0).astype(np.float32), digits.target[order].astype(np.int32)
    x_train, y_train, x_val, y_val = x_all[:1500], y_all[:1500], x_all[1500:], y_all[1500:]

    # Global arrays replicated over the mesh: every process gives its own (equal) full copy.
    params = jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(replicated, a), init_params([64, args.hidden, 10])
    )

    def local_step(params, x, y):  # runs on each device with its shard of the batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "data")  # the all-reduce across processes (gloo on CPU)
        params = jax.tree.map(lambda p, g: p - args.lr * g, params, grads)
        return params, jax.lax.pmean(loss, "data")

    # check_vma=False: the gradient stays this device's own, and the pmean above is the one
    # all-reduce. (With the default check_vma=True, JAX already sums the gradient of a replicated
    # input across the axis, and a pmean of that sum is a no-op: the step would be world times
    # too large.)
    step = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()), check_vma=False
        ),
        donate_argnums=0,
    )

    local_batch = args.batch_size // world
    batches = np.random.default_rng(1)  # the same global batches on every process, whatever the count
    for n in range(1, args.steps + 1):
        rows = batches.choice(len(y_train), args.batch_size, replace=False)
        mine = rows[rank * local_batch : (rank + 1) * local_batch]  # this process's shard
        x = jax.make_array_from_process_local_data(split, x_train[mine])
        y = jax.make_array_from_process_local_data(split, y_train[mine])
        params, loss = step(params, x, y)
        if rank == 0 and (n == 1 or n % args.log_every == 0 or n == args.steps):
            print(f"step {n} loss {float(loss):.4f}", flush=True)

    local = jax.tree.map(lambda a: a.addressable_data(0), params)  # this process's copy
    accuracy = float(jax.jit(lambda p: jnp.mean(jnp.argmax(forward(p, x_val), axis=1) == y_val))(local))
    print(f"process {rank} val_accuracy {accuracy:.4f}", flush=True)
    print(f"final-checksum: {checksum(params)}", flush=True)  # every process: the test compares them


if __name__ == "__main__":
    main()
