"""The PyTorch training scripts the tests run under coord (torchrun, Accelerate, DeepSpeed), and the exact
arithmetic their uninterrupted run does, to prove a resume exact.

Each is a real distributed job on the CPU (Gloo): a linear model, data drawn from the step and the
rank alone (so an attempt that resumes at step S sees the examples an uninterrupted run sees there),
checkpoints as directories through coord_script, progress through coord_script.report.
"""

from __future__ import annotations

#: torch.distributed + DDP, launched by torchrun. Rank 0 saves ``state.pt`` and ``COMPLETE`` in the
#: step's directory; every rank loads the resume directory. ``--fail-at S``: on the first attempt,
#: global rank 1 raises at step S (torchrun's error file names it); ``--hang-at S``: it stops there;
#: ``--abort-at-exit``: it aborts (SIGABRT) after its last step and the process group's end;
#: ``--nan-at S``: on the first attempt every weight turns NaN at step S (the loss too, from there on),
#: as a run that diverged. After a rollback it skips the batches coord_script.skip_batches() says
#: (kept in each checkpoint, so that a later resume draws the same data).
DDP = '''\
import argparse, os, signal, time
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
import coord_script

@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--abort-at-exit", action="store_true")
    parser.add_argument("--nan-at", type=int)
    parser.add_argument("--work", type=int, default=0, help="matrix products of 128 x 128 added to each forward pass "
                        "(compute a CPU quota can hold back; the model and its losses are the same)")
    args = parser.parse_args()
    dist.init_process_group(os.environ.get("COORD_TORCH_BACKEND", "gloo"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = coord_script.step_offset()
    skipped = 0
    if coord_script.resume_dir():
        state = torch.load(os.path.join(coord_script.resume_dir(), "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        skipped = state.get("skipped", 0)
    if coord_script.skip_batches():
        skipped += coord_script.skip_batches()
        if rank == 0:
            print(f"skipping {coord_script.skip_batches()} batches after the rollback", flush=True)
    ddp = DistributedDataParallel(model)
    save_every = int(os.environ.get("COORD_SAVE_EVERY", "0"))
    first = os.environ.get("COORD_ATTEMPT", "0") == "0"
    accumulation = int(os.environ.get("COORD_GRAD_ACCUM", "0"))  # with --global-batch: kept on a shrink
    micro = int(os.environ.get("COORD_MICRO_BATCH", "8"))
    if rank == 0 and accumulation:
        print(f"global batch {micro * dist.get_world_size() * accumulation} = {micro} x {dist.get_world_size()} "
              f"x {accumulation}", flush=True)
    for step in range(start + 1, args.steps + 1):
        optimizer.zero_grad()
        if first and args.nan_at == step:
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(float("nan"))
        compute = 0.0  # the forward passes: the part of a step outside DDP's all-reduce (backward holds it)
        for part in range(max(1, accumulation)):
            generator = torch.Generator().manual_seed((step + skipped) * 1000 + rank + 100 * part)
            began = time.perf_counter()
            x = torch.randn(micro, 4, generator=generator)
            loss = ((ddp(x) - x.sum(1, keepdim=True)) ** 2).mean() / max(1, accumulation)
            for _ in range(args.work):
                torch.ones(128, 128) @ torch.ones(128, 128)
            compute += time.perf_counter() - began
            loss.backward()
        optimizer.step()
        if rank == 1 and first and args.fail_at == step:
            raise RuntimeError(f"the data loader broke at step {step}")
        if rank == 1 and first and args.hang_at == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if rank != 0:
            coord_script.report(step, compute_seconds=compute)  # every rank: the watch of stragglers
        if rank == 0:
            coord_script.report(step, loss=loss.item(), compute_seconds=compute)
            if save_every and (step % save_every == 0 or step == args.steps):
                directory = coord_script.checkpoint_dir(step - start)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "skipped": skipped},
                           os.path.join(directory, "state.pt"))
                open(os.path.join(directory, "COMPLETE"), "w").close()
        time.sleep(args.sleep)
    if rank == 0 and os.environ.get("COORD_CHECKPOINT_DIR"):
        torch.save(model.state_dict(), os.path.join(os.environ["COORD_CHECKPOINT_DIR"], "final.pt"))
    dist.barrier()  # rank 0 may still be saving: Gloo aborts a peer that leaves before the others
    dist.destroy_process_group()
    if rank == 1 and first and args.abort_at_exit:
        os.abort()  # as Gloo now and then aborts a worker at interpreter exit

main()
'''


def expected_weights(steps: int, world: int) -> list[float]:
    """The weights and bias DDP reaches after ``steps`` uninterrupted steps on ``world`` ranks: the
    same arithmetic in one process (DDP divides each rank's gradient by the world, then sums them)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, steps + 1):
        grads = []
        for rank in range(world):
            model.zero_grad()
            generator = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(8, 4, generator=generator)
            ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
            grads.append([p.grad.clone() / world for p in model.parameters()])
        for index, param in enumerate(model.parameters()):
            total = grads[0][index]
            for other in grads[1:]:
                total = total + other[index]
            param.grad = total
        optimizer.step()
    return [*model.weight.detach().flatten().tolist(), *model.bias.detach().tolist()]


#: DeepSpeed ZeRO-2 on the CPU (its CPU accelerator takes Gloo), started by DeepSpeed's runner on every node:
#: the data and model of DDP (so ``expected_weights`` is its uninterrupted result), the config from
#: ``coord run --plan`` ($COORD_DEEPSPEED_CONFIG) or the project's ds.json, save_checkpoint into the step's
#: directory on every process (rank 0 writes the model states and ``latest``, each rank its own ZeRO
#: states, on its own node: coord joins them) and load_checkpoint from the resume directory.
DEEPSPEED = '''\
import argparse, json, os, time
import torch
import deepspeed
import coord_script

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--local_rank", type=int, default=0)  # DeepSpeed's launcher gives each process its own
args = parser.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
with open(coord_script.deepspeed_config() or "ds.json") as file:
    config = json.load(file)
if rank == 0:
    print(f"ds config: stage {config['zero_optimization']['stage']}, batch {config['train_batch_size']}", flush=True)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                       config=config)
start = coord_script.step_offset()
if coord_script.resume_dir():
    engine.load_checkpoint(coord_script.resume_dir())
micro = config["train_micro_batch_size_per_gpu"]
save_every = int(os.environ.get("COORD_SAVE_EVERY", "0"))
for step in range(start + 1, args.steps + 1):
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    began = time.perf_counter()
    x = torch.randn(micro, 4, generator=generator)
    loss = ((engine(x) - x.sum(1, keepdim=True)) ** 2).mean()
    compute = time.perf_counter() - began  # the forward pass: outside the collectives
    engine.backward(loss)
    engine.step()
    if rank == 0:
        coord_script.report(step, loss=loss.item(), compute_seconds=compute)
    else:
        coord_script.report(step, compute_seconds=compute)
    if save_every and (step % save_every == 0 or step == args.steps):
        engine.save_checkpoint(coord_script.checkpoint_dir(step - start), tag=f"global_step{step}")
    time.sleep(args.sleep)
if rank == 0 and os.environ.get("COORD_CHECKPOINT_DIR"):
    torch.save(engine.module.state_dict(), os.path.join(os.environ["COORD_CHECKPOINT_DIR"], "final.pt"))
torch.distributed.barrier()
'''

#: The project's own DeepSpeed config for DEEPSPEED: ZeRO-2 over two processes of 8 examples each, no
#: gradient clipping (DeepSpeed 0.19 clips to a norm of 1.0 unless told otherwise: DDP's arithmetic has none).
DEEPSPEED_CONFIG = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                    "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}


#: Accelerate (MULTI_CPU): a data set read in order by a prepared DataLoader (each process its own
#: batches), save_state/load_state into the step's directory on every process (the random states of
#: each rank land on its own node: coord joins them), skip_first_batches on a resume.
ACCELERATE = '''\
import argparse, os, time
import torch
from accelerate import Accelerator
import coord_script

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()
accelerator = Accelerator(log_with=[coord_script.accelerate_tracker()])  # its log() is coord's progress
accelerator.init_trackers("acc")
if accelerator.is_main_process and os.environ.get("COORD_GRAD_ACCUM"):  # the batch coord keeps (a plan's)
    print(f"batch: global {os.environ['COORD_GLOBAL_BATCH']}, accumulation {os.environ['COORD_GRAD_ACCUM']}",
          flush=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
start = coord_script.step_offset()
if coord_script.resume_dir():
    accelerator.load_state(coord_script.resume_dir())
save_every = int(os.environ.get("COORD_SAVE_EVERY", "0"))
step = start
while step < args.steps:
    epoch_loader = loader
    if step == start and start % len(loader):
        epoch_loader = accelerator.skip_first_batches(loader, start % len(loader))
    for batch_x, batch_y in epoch_loader:
        loss = ((model(batch_x) - batch_y) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        accelerator.log({"loss": loss.item()}, step=step)
        if save_every and (step % save_every == 0 or step == args.steps):
            accelerator.save_state(coord_script.checkpoint_dir(step - start))
        time.sleep(args.sleep)
        if step >= args.steps:
            break
accelerator.wait_for_everyone()
if accelerator.is_main_process and os.environ.get("COORD_CHECKPOINT_DIR"):
    unwrapped = accelerator.unwrap_model(model)
    torch.save(unwrapped.state_dict(), os.path.join(os.environ["COORD_CHECKPOINT_DIR"], "final.pt"))
accelerator.end_training()
'''


def expected_accelerate_weights(steps: int, world: int) -> list[float]:
    """What ACCELERATE reaches after ``steps`` uninterrupted steps on ``world`` processes: process p
    takes batch p, p + world, ... of each epoch (48 examples: 12 batches, even for 2, 3 or 4 processes);
    DDP averages the gradients."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 48, 4)]
    per_step = len(batches) // world
    for step in range(steps):
        within = step % per_step
        grads = []
        for rank in range(world):
            model.zero_grad()
            bx, by = batches[within * world + rank]
            ((model(bx) - by) ** 2).mean().backward()
            grads.append([p.grad.clone() / world for p in model.parameters()])
        for index, param in enumerate(model.parameters()):
            total = grads[0][index]
            for other in grads[1:]:
                total = total + other[index]
            param.grad = total
        optimizer.step()
    return [*model.weight.detach().flatten().tolist(), *model.bias.detach().tolist()]


#: Hugging Face Trainer under torchrun (DDP over Gloo on CPUs), its steps and logged loss reported to coord
#: by coord_script's callback.
HF_TRAINER = '''\
import os, sys, torch
from transformers import Trainer, TrainingArguments
import coord_script

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": ((self.linear(x) - y) ** 2).mean()}

class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True)}

args = TrainingArguments(output_dir=os.path.join(os.environ.get("COORD_CHECKPOINT_DIR", "."), "hf"),
                         max_steps=int(sys.argv[1]), per_device_train_batch_size=4, logging_steps=5,
                         save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True)
Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[coord_script.hf_callback()]).train()
# Gloo aborts a worker at interpreter exit now and then (3 of 17 bare two-node torchrun runs here, none
# of 25 ended with os._exit); this job saves no checkpoint of its last step, so coord would rerun it
# (docs/pytorch.md), and this test is about its progress: the process ends here, as the docs advise.
os._exit(0)
'''
