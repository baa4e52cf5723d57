# A training script written for Horovod (`import horovod.torch as hvd`), ported to hvdlite by
# changing that import line and nothing else. Run it with
#     hvdliterun -np 2 python examples/horovod_port/train.py
# (or alone: python examples/horovod_port/train.py). The data is scikit-learn's bundled digits
# set, so nothing is downloaded.
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import hvdlite as hvd

parser = argparse.ArgumentParser(description="digits example in the Horovod style")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.02)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--num-groups", type=int, default=0)
parser.add_argument("--timeline", default=None, help="write a timeline of the first epoch here")
args = parser.parse_args()

hvd.init()
if hvd.rank() == 0:
    print("ranks: {}, homogeneous: {}, CCL: {}, CUDA: {}".format(
        hvd.size(), hvd.is_homogeneous(), hvd.ccl_built(), hvd.cuda_built()))
torch.manual_seed(args.seed)
torch.set_num_threads(1)

images, labels = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(images / 16.0, dtype=torch.float32),
                                         torch.tensor(labels))
train_set, test_set = torch.utils.data.random_split(
    dataset, [1400, len(dataset) - 1400], generator=torch.Generator().manual_seed(args.seed))

# Partition the data among the workers.
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_set, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                           sampler=train_sampler)
test_sampler = torch.utils.data.distributed.DistributedSampler(
    test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
test_loader = torch.utils.data.DataLoader(test_set, batch_size=256, sampler=test_sampler)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


model = Net()

# Scale the learning rate by the number of workers (Adasum does not need it).
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

# Broadcast the parameters and the optimizer state from rank 0 to all other processes.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=model)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average,
                                     groups=args.num_groups)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    if hvd.rank() == 0:
        print("Train Epoch: {} \tLoss: {:.6f}".format(epoch, loss.item()))


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            test_accuracy += output.argmax(1).eq(target).float().sum().item()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print("\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n".format(
            test_loss, 100. * test_accuracy))


for epoch in range(1, args.epochs + 1):
    if args.timeline and epoch == 1:
        hvd.start_timeline(args.timeline)
    train(epoch)
    if args.timeline and epoch == 1:
        hvd.stop_timeline()
hvd.join()
test()
