"""dsgd as a Ray Train backend: the user's loop runs in Ray Train's workers and
averages gradients through dsgd's sharded PS actors (see README "Ray Train").

    from dsgd.train import DsgdTrainer, DsgdConfig
    from dsgd.train import DistributedGradientTape, DistributedOptimizer, broadcast_variables
"""

from dsgd.train.config import DsgdBackend, DsgdConfig
from dsgd.train.tape import DistributedGradientTape, DistributedOptimizer, broadcast_variables
from dsgd.train.trainer import DsgdTrainer

__all__ = ["DsgdTrainer", "DsgdConfig", "DsgdBackend", "DistributedGradientTape",
           "DistributedOptimizer", "broadcast_variables"]
