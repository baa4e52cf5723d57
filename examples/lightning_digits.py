"""The digits task (scikit-learn's bundled 8x8 digits) as a LightningModule, trained by
Lightning's Trainer on hvdlite's strategy.

    python examples/lightning_digits.py                       # one process
    hvdliterun -np 2 python examples/lightning_digits.py      # two ranks
    torchrun --nproc-per-node 2 examples/lightning_digits.py  # the same under torchrun

`import hvdlite.lightning` registers the strategy "hvdlite"; the ranks come from the launcher.
Lightning gives each rank its share of the training set (a DistributedSampler), the strategy
averages the gradients, and the test accuracy is logged with sync_dist=True, so the last line,
printed by rank 0, is the accuracy over the whole test set. The batch size is the global one,
split over the ranks, so that N ranks take the steps one process takes (with the same learning
rate): the strategy itself never changes the learning rate behind the user's back.
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvdlite as hvd
import hvdlite.lightning  # noqa: F401  (registers the Lightning strategy "hvdlite")


class Digits(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def test_step(self, batch, _):
        x, y = batch
        correct = (self.net(x).argmax(1) == y).sum().float()
        # summed over the ranks and the batches: the counts of the whole test set
        self.log("test_correct", correct, reduce_fx="sum", sync_dist=True)
        self.log("test_count", float(len(y)), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="global: split over the ranks")
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    torch.set_num_threads(1)
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(images / 16.0, labels, test_size=0.25,
                                                        random_state=0, stratify=labels)
    train = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
    test = TensorDataset(torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test))

    trainer = pl.Trainer(strategy="hvdlite", accelerator="cpu", max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    size = trainer.world_size  # hvd.init() has read the launcher
    model = Digits(args.lr)
    trainer.fit(model, DataLoader(train, batch_size=max(1, args.batch_size // size), shuffle=True))
    # Lightning splits the test set over the ranks too (450 examples: on 1, 2, 3 or 5 ranks each
    # counts once; on other sizes its sampler repeats a few to even the shares)
    metrics = trainer.test(model, DataLoader(test, batch_size=256), verbose=False)[0]
    if trainer.is_global_zero:
        accuracy = 100.0 * metrics["test_correct"] / metrics["test_count"]
        print(f"test accuracy: {accuracy:.2f}% ({int(metrics['test_correct'])}/{int(metrics['test_count'])}) "
              f"on {size} rank(s) with hvdlite {hvd.__version__}", flush=True)


if __name__ == "__main__":
    main()
