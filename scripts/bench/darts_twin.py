"""memtrain's `darts` preset (src/model/darts.rs) in plain PyTorch, for the benchmark.

The module tree mirrors memtrain's parameter names (`stem.conv.weight`, `cells.<i>.edges.<e>.<op>.*`,
`arch.alpha_normal`, ...), so one safetensors file initialises both: written by `init` from this
module's state (less the `num_batches_tracked` counters memtrain does not keep) and read by
memtrain through model.init_from. The forward pass does what memtrain's does, in the same order
(each edge sums its ops in op order, each node its edges in input order), so fp32 losses agree.
"""
import functools

import torch
import torch.nn.functional as F
from torch import nn

STEM_MULTIPLIER = 3


def bn(c, affine=False):
    return nn.BatchNorm1d(c, affine=affine)


def conv1d(cin, cout, k, stride=1, dilation=1, groups=1):
    return nn.Conv1d(cin, cout, k, stride=stride, padding=dilation * (k - 1) // 2, dilation=dilation,
                     groups=groups, bias=False)


def avg_pool_3(x, stride):
    return F.avg_pool1d(x, 3, stride, 1, ceil_mode=False, count_include_pad=False)


def kernel(name):
    return 5 if name.endswith("_5") or name.endswith("5x1") else 3


class ReluConvBn(nn.Module):
    def __init__(self, cin, cout, k, stride):
        super().__init__()
        self.conv = conv1d(cin, cout, k, stride)
        self.bn = bn(cout)

    def forward(self, x):
        return self.bn(self.conv(x.relu()))


class FactorizedReduce(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        half = cout // 2
        self.conv1 = conv1d(cin, half, 1, 2)
        self.conv2 = conv1d(cin, cout - half, 1, 2)
        self.bn = bn(cout)

    def forward(self, x):
        x = x.relu()
        length = x.shape[2]
        a = self.conv1(x)
        out_len = (length + 1) // 2
        if length > 1:
            b = self.conv2(x[:, :, 1:])
            short = out_len - b.shape[2]
            if short > 0:
                b = F.pad(b, (0, short))
        else:
            b = x.new_zeros([x.shape[0], self.conv2.weight.shape[0], out_len])
        return self.bn(torch.cat([a, b], 1))


class Identity(nn.Module):
    def forward(self, x):
        return x


class Pool(nn.Module):
    def __init__(self, kind, c, stride):
        super().__init__()
        self.kind, self.stride = kind, stride
        self.bn = bn(c)

    def forward(self, x):
        if self.kind == "max":
            return self.bn(F.max_pool1d(x, 3, self.stride, 1))
        return self.bn(avg_pool_3(x, self.stride))


class SepConv(nn.Module):
    def __init__(self, c, k, stride):
        super().__init__()
        self.dw1, self.pw1, self.bn1 = conv1d(c, c, k, stride, groups=c), conv1d(c, c, 1), bn(c)
        self.dw2, self.pw2, self.bn2 = conv1d(c, c, k, groups=c), conv1d(c, c, 1), bn(c)

    def forward(self, x):
        y = self.bn1(self.pw1(self.dw1(x.relu())))
        return self.bn2(self.pw2(self.dw2(y.relu())))


class DilConv(nn.Module):
    def __init__(self, c, k, stride):
        super().__init__()
        self.dw, self.pw, self.bn = conv1d(c, c, k, stride, dilation=2, groups=c), conv1d(c, c, 1), bn(c)

    def forward(self, x):
        return self.bn(self.pw(self.dw(x.relu())))


class Disjoint(nn.Module):
    def __init__(self, c, k, stride):
        super().__init__()
        self.temporal = nn.Conv2d(1, c, (1, k), stride=(1, stride), padding=(0, (k - 1) // 2), bias=False)
        self.bn1 = nn.BatchNorm2d(c, affine=False)
        self.spatial = nn.Conv2d(c, c, (c, 1), bias=False)
        self.bn2 = nn.BatchNorm2d(c, affine=False)

    def forward(self, x):
        y = self.bn1(self.temporal(x.relu().unsqueeze(1)))
        return self.bn2(self.spatial(y.relu())).squeeze(2)


class Lstm(nn.Module):
    def __init__(self, c, stride):
        super().__init__()
        self.stride, self.channels = stride, c
        self.lstm = nn.LSTM(c, (c + 1) // 2, bidirectional=True, batch_first=True)
        self.bn = bn(c)

    def forward(self, x):
        if self.stride > 1:
            x = avg_pool_3(x, self.stride)
        y, _ = self.lstm(x.transpose(1, 2).contiguous())
        y = y.transpose(1, 2)
        if y.shape[1] > self.channels:
            y = y.narrow(1, 0, self.channels)
        return self.bn(y)


class Attention(nn.Module):
    def __init__(self, c, heads, stride):
        super().__init__()
        self.heads, self.stride = heads, stride
        self.qkv, self.proj, self.bn = nn.Linear(c, 3 * c), nn.Linear(c, c), bn(c)

    def forward(self, x):
        if self.stride > 1:
            x = avg_pool_3(x, self.stride)
        n, c, length = x.shape
        d = c // self.heads
        qkv = self.qkv(x.transpose(1, 2)).view(n, length, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        y = self.proj(y.transpose(1, 2).reshape(n, length, c))
        return self.bn(y.transpose(1, 2))


def make_op(name, c, stride):
    if name == "skip_connect":
        return Identity() if stride == 1 else FactorizedReduce(c, c)
    if name in ("max_pool_3", "avg_pool_3"):
        return Pool(name[:3], c, stride)
    if name in ("conv_3", "conv_5"):
        return ReluConvBn(c, c, kernel(name), stride)
    if name.startswith("sep_conv"):
        return SepConv(c, kernel(name), stride)
    if name.startswith("dil_conv"):
        return DilConv(c, kernel(name), stride)
    if name.startswith("disjoint_cnn"):
        return Disjoint(c, kernel(name), stride)
    if name == "lstm":
        return Lstm(c, stride)
    if name in ("attention", "attention_light"):
        return Attention(c, 4 if name == "attention" else 2, stride)
    raise ValueError(f"unknown DARTS operation {name!r}")


def add(xs):
    return functools.reduce(lambda a, b: a + b, xs)


class Edge(nn.ModuleDict):
    """Keyed by op name, which gives memtrain's `edges.<e>.<op>.*` names."""

    def __init__(self, ops, c, stride):
        index = [k for k, name in enumerate(ops) if name != "none"]
        super().__init__({ops[k]: make_op(ops[k], c, stride) for k in index})
        self.index = index

    def forward(self, x, w):
        return add([op(x) * w[k] for k, op in zip(self.index, self.values())])


class Cell(nn.Module):
    def __init__(self, ops, num_nodes, c_pp, c_p, c, reduction, reduction_prev):
        super().__init__()
        self.reduction, self.num_nodes = reduction, num_nodes
        self.pre0 = FactorizedReduce(c_pp, c) if reduction_prev else ReluConvBn(c_pp, c, 1, 1)
        self.pre1 = ReluConvBn(c_p, c, 1, 1)
        self.edges = nn.ModuleList(
            Edge(ops, c, 2 if reduction and j < 2 else 1) for i in range(num_nodes) for j in range(2 + i))

    def forward(self, s0, s1, w):
        states = [self.pre0(s0), self.pre1(s1)]
        e = 0
        for i in range(self.num_nodes):
            states.append(add([self.edges[e + j](x, w[e + j]) for j, x in enumerate(states)]))
            e += 2 + i
        return torch.cat(states[2:], 1)


class Arch(nn.Module):
    def __init__(self, edges, ops):
        super().__init__()
        self.alpha_normal = nn.Parameter(1e-3 * torch.randn(edges, ops))
        self.alpha_reduce = nn.Parameter(1e-3 * torch.randn(edges, ops))


class Darts(nn.Module):
    def __init__(self, in_channels, num_classes, init_channels, num_cells, num_nodes, ops, **_):
        super().__init__()
        c_stem = STEM_MULTIPLIER * init_channels
        self.stem = nn.Sequential()
        self.stem.add_module("conv", conv1d(in_channels, c_stem, 3))
        self.stem.add_module("bn", bn(c_stem, affine=True))
        reductions = sorted({num_cells // 3, 2 * num_cells // 3})
        c_pp, c_p, c = c_stem, c_stem, init_channels
        reduction_prev = False
        cells = []
        for i in range(num_cells):
            reduction = i in reductions
            if reduction:
                c *= 2
            cells.append(Cell(ops, num_nodes, c_pp, c_p, c, reduction, reduction_prev))
            reduction_prev = reduction
            c_pp, c_p = c_p, num_nodes * c
        self.cells = nn.ModuleList(cells)
        self.classifier = nn.Linear(c_p, num_classes)
        self.arch = Arch(sum(2 + i for i in range(num_nodes)), len(ops))

    def weights(self):
        return [self.arch.alpha_normal.softmax(-1), self.arch.alpha_reduce.softmax(-1)]

    def head(self, s1):
        return self.classifier(s1.mean(-1))

    def forward(self, x, checkpointing=False):
        normal, reduce = self.weights()
        run = self._checkpointed if checkpointing else (lambda f, *a: f(*a))
        s = run(self.stem, x)
        s0, s1 = s, s
        for cell in self.cells:
            s0, s1 = s1, run(cell, s0, s1, reduce if cell.reduction else normal)
        return self.head(s1)

    @staticmethod
    def _checkpointed(f, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(f, *args, use_reentrant=False)

    def state_for_memtrain(self):
        return {k: v for k, v in self.state_dict().items() if not k.endswith("num_batches_tracked")}

    def load_from_memtrain(self, state):
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("num_batches_tracked")]
        if missing or unexpected:
            raise ValueError(f"darts twin: missing {missing}, unexpected {unexpected}")

    def weight_parameters(self):
        return [p for n, p in sorted(self.named_parameters()) if not n.startswith("arch.")]

    def arch_parameters(self):
        return [p for n, p in sorted(self.named_parameters()) if n.startswith("arch.")]
