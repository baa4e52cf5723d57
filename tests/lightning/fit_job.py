"""One Lightning fit, started by a launcher (hvdliterun, torchrun, srun) or alone, writing each
rank's final parameters to OUT/<tag>.rank<r>.pt. The tests compare them with reference_fit(),
one process on the combined batch.

    python tests/lightning/fit_job.py OUT TAG STRATEGY [--optimizer sgd|adam] [--accumulate N]
                                                       [--clip NORM] [--devices N]
    python tests/lightning/fit_job.py OUT - STRATEGY --case TAG=OPTIONS [--case ...]
"""
import argparse
import os
import shlex
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import hvdlite  # noqa: E402,F401  (registers the torch.distributed backend)
import lightning.pytorch as pl  # noqa: E402

SAMPLES, PER_RANK, FEATURES = 64, 8, 6


def dataset():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def optimizer(name, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Regression(pl.LightningModule):
    def __init__(self, optimizer_name, fail_rank=-1, scheduler=False):
        super().__init__()
        self.net = model()
        self.optimizer_name = optimizer_name
        self.fail_rank = fail_rank
        self.scheduler = scheduler
        self.seen = {}

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and batch_idx == 2:
            raise ValueError(f"training_step failed on purpose on rank {self.global_rank}")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("rank_mean", float(self.global_rank), sync_dist=True)  # the mean over ranks
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, _):
        return self.net(batch[0])

    def on_train_end(self):
        # the strategy's collectives, as a LightningModule calls them
        rank = self.global_rank
        mine = torch.tensor([rank + 1.0, 10.0 * rank])
        s = self.trainer.strategy
        self.seen = {
            "all_gather": self.all_gather(mine).tolist(),
            "sum": s.reduce(mine.clone(), reduce_op="sum").tolist(),
            "mean": s.reduce(mine.clone(), reduce_op="mean").tolist(),
            "max": s.reduce(mine.clone(), reduce_op="max").tolist(),
            "min": s.reduce(mine.clone(), reduce_op="min").tolist(),
            "broadcast": s.broadcast({"from": rank}, src=1),
        }
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        gathered = self.all_gather(x * x, sync_grads=True)  # d/dx of sum over every rank's x*x
        gathered.sum().backward()
        self.seen["grad"] = x.grad.tolist()
        s.barrier()

    def configure_optimizers(self):
        opt = optimizer(self.optimizer_name, self.parameters())
        if not self.scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
                                                   "interval": "step"}}


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers (SGD for one network, Adam for the other)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = model()
        torch.manual_seed(1)
        self.other = torch.nn.Linear(FEATURES, 1)
        self.seen = {}

    def training_step(self, batch, _):
        x, y = batch
        first, second = self.optimizers()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        first.zero_grad()
        self.manual_backward(loss)
        first.step()
        other = torch.nn.functional.mse_loss(self.other(x), y)
        second.zero_grad()
        self.manual_backward(other)
        second.step()
        self.log("train_loss", loss, sync_dist=True)
        self.log("rank_mean", float(self.global_rank), sync_dist=True)

    def configure_optimizers(self):
        return optimizer("sgd", self.net.parameters()), optimizer("adam", self.other.parameters())


def _orders(size, epoch):
    orders = []
    for r in range(size):
        sampler = torch.utils.data.DistributedSampler(range(SAMPLES), size, r, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def reference_manual(size, epochs=2):
    """TwoOptimizers in one process on the combined batch: both networks' parameters."""
    net = model()
    torch.manual_seed(1)
    other = torch.nn.Linear(FEATURES, 1)
    first, second = optimizer("sgd", net.parameters()), optimizer("adam", other.parameters())
    x, y = dataset().tensors
    for epoch in range(epochs):
        orders = _orders(size, epoch)
        for step in range(SAMPLES // (PER_RANK * size)):
            batches = [order[step * PER_RANK:(step + 1) * PER_RANK] for order in orders]
            for module, opt in ((net, first), (other, second)):
                opt.zero_grad()
                (sum(torch.nn.functional.mse_loss(module(x[b]), y[b]) for b in batches) / size).backward()
                opt.step()
    return [p.detach() for p in net.parameters()] + [p.detach() for p in other.parameters()]


def one_process(steps, optimizer_name="sgd", accumulate=1, clip=None, scheduler=False, scale=1.0,
                clip_value=None):
    """One process taking, at each step, the mean loss of the ranks' batches (`steps`: for each
    step, every rank's sample indices) times `scale`, accumulating, clipping and scheduling as
    told."""
    net = model()
    opt = optimizer(optimizer_name, net.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if scheduler else None
    x, y = dataset().tensors
    for step, batches in enumerate(steps):
        losses = [torch.nn.functional.mse_loss(net(x[b]), y[b]) for b in batches]
        (scale * sum(losses) / len(batches) / accumulate).backward()
        if (step + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(net.parameters(), clip_value)
            opt.step()
            opt.zero_grad()
            if schedule is not None:
                schedule.step()
    return [p.detach() for p in net.parameters()]


def reference_fit(size, epochs=2, **options):
    """One process on the combined batch of `size` ranks: step k takes every rank's k-th batch
    of the order Lightning's DistributedSampler gives the training data (shuffled with seed 0,
    reseeded each epoch). The steps per epoch are a multiple of any accumulation tested."""
    steps = []
    for epoch in range(epochs):
        orders = _orders(size, epoch)
        steps += [[order[k * PER_RANK:(k + 1) * PER_RANK] for order in orders]
                  for k in range(SAMPLES // (PER_RANK * size))]
    return one_process(steps, **options)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("strategy")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--clip-value", type=float, default=None, help="gradient_clip_algorithm='value'")
    parser.add_argument("--devices", default=None, help="the Trainer's devices (DDPStrategy: per host)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--save", default=None, help="trainer.save_checkpoint() to this path at the end")
    parser.add_argument("--resume", default=None, help="fit from this checkpoint")
    parser.add_argument("--manual", action="store_true", help="TwoOptimizers, manual optimization")
    parser.add_argument("--scheduler", action="store_true", help="StepLR(2, 0.5) every step")
    parser.add_argument("--stages", action="store_true", help="validate() and predict() after fit()")
    parser.add_argument("--fast-dev-run", action="store_true")
    parser.add_argument("--option", default=None, help="fp16 | predivide | sum: a strategy option")
    parser.add_argument("--case", action="append", default=[], metavar="TAG=OPTIONS",
                        help="fit once per case, as TAG with these options (one process, several fits)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.case:
        fit(args)
        return
    # Several cases in one launch (each test of a launch costs seconds of process start): every
    # fit builds its own strategy and Trainer, so each one's teardown shuts hvdlite down and the
    # next one's setup initializes it again.
    for case in args.case:
        tag, _, options = case.partition("=")
        fit(parser.parse_args([args.out, tag, args.strategy, *shlex.split(options)]))


def fit(args):
    if args.strategy == "ddp-hvdlite":
        from lightning.pytorch.strategies import DDPStrategy
        strategy = DDPStrategy(process_group_backend="hvdlite")
    else:
        import hvdlite.lightning  # registers the strategy "hvdlite"
        strategy = args.strategy
        if args.option:
            options = {"fp16": {"compression": hvdlite.Compression.fp16},
                       "predivide": {"gradient_predivide_factor": 2.0},
                       "sum": {"op": hvdlite.Sum}}[args.option]
            strategy = hvdlite.lightning.HvdliteStrategy(**options)
    devices = int(args.devices) if args.devices else ("auto" if strategy == "hvdlite" else 2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=args.epochs,
                         precision=args.precision,
                         accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=args.clip if args.clip_value is None else args.clip_value,
                         gradient_clip_algorithm="norm" if args.clip_value is None else "value",
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, fast_dev_run=args.fast_dev_run)
    module = TwoOptimizers() if args.manual else Regression(args.optimizer, args.fail_rank, args.scheduler)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=PER_RANK, shuffle=False)
    trainer.fit(module, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    written = os.path.exists(args.save) if args.save else None
    fitted = {k: trainer.callback_metrics[k].item() for k in ("train_loss", "rank_mean")}
    stages = {}
    if args.stages:
        eval_loader = torch.utils.data.DataLoader(dataset(), batch_size=PER_RANK, shuffle=False)
        stages["val_loss"] = trainer.validate(module, eval_loader, verbose=False)[0]["val_loss"]
        stages["predicted"] = torch.cat(trainer.predict(module, eval_loader))
    torch.save({"params": [p.detach() for p in module.parameters()],
                "loss": fitted["train_loss"], "rank": trainer.global_rank,
                "size": trainer.world_size, "rank_mean": fitted["rank_mean"],
                "seen": module.seen, "written": written, "stages": stages},
               os.path.join(args.out, f"{args.tag}.rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
