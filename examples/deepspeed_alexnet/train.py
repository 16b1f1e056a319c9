#!/usr/bin/env python3
"""DeepSpeed's pipeline-parallel AlexNet example (DeepSpeedExamples,
training/pipeline_parallelism/train.py) on pipesched.

What differs from the original, line for line:
- the three DeepSpeed imports point at `pipeline.interop.deepspeed_compat`;
- torchvision has no CPU build here: `AlexNet` is defined below with torchvision's
  architecture, and `cifar_trainset` makes synthetic CIFAR-10-shaped data instead of
  downloading it (image side SYNTHETIC_IMAGE_SIZE, default 224 as the original's crop);
- `torch.cuda.set_device` runs only when CUDA exists (it fails on a CPU-only torch, with
  DeepSpeed too);
- the non-pipeline `train_base` path (``-p 0``) is left out: it uses DeepSpeed's data-parallel
  engine, which is not part of the pipeline API.

Run: torchrun --standalone --nproc_per_node 2 examples/deepspeed_alexnet/train.py \
         --deepspeed_config examples/deepspeed_alexnet/ds_config.json -p 2 --steps 20 \
         --backend gloo
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import pipeline.interop.deepspeed_compat as deepspeed
from pipeline.interop.deepspeed_compat import PipelineModule, RepeatingLoader  # noqa: F401


class AlexNet(nn.Module):
    """torchvision's AlexNet architecture (features, 6×6 average pool, classifier)."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class SyntheticCifar(torch.utils.data.Dataset):
    """CIFAR-10's shape after the original's transform: (3, side, side) images, 10 classes."""

    def __init__(self, size: int = 50000, side: int = 224) -> None:
        self.size, self.side = size, side

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        image = torch.randn(3, self.side, self.side, generator=generator)
        return image, int(torch.randint(0, 10, (1,), generator=generator))


def cifar_trainset(local_rank, dl_path='/tmp/cifar10-data'):
    # no download here: synthetic data of the same shape (see the module docstring)
    side = int(os.environ.get("SYNTHETIC_IMAGE_SIZE", "224"))
    return SyntheticCifar(size=int(os.environ.get("SYNTHETIC_SAMPLES", "50000")), side=side)


def get_args():
    parser = argparse.ArgumentParser(description='CIFAR')
    parser.add_argument('--local_rank', type=int, default=-1,
                        help='local rank passed from distributed launcher')
    parser.add_argument('-s', '--steps', type=int, default=100, help='quit after this many steps')
    parser.add_argument('-p', '--pipeline-parallel-size', type=int, default=2,
                        help='pipeline parallelism')
    parser.add_argument('--backend', type=str, default='nccl', help='distributed backend')
    parser.add_argument('--seed', type=int, default=1138, help='PRNG seed')
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    return args


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def train_pipe(args, part='parameters'):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    #
    # Build the model
    #

    # VGG also works :-)
    #net = vgg19(num_classes=10)
    net = AlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net),
                         loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size,
                         partition_method=part,
                         activation_checkpoint_interval=0)

    trainset = cifar_trainset(args.local_rank)

    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)

    for step in range(args.steps):
        loss = engine.train_batch()


if __name__ == '__main__':
    args = get_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ['LOCAL_RANK'])
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)

    train_pipe(args)
