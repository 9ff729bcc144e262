"""What the algorithms share, one concern per module; every algorithm module imports from
here and none of these imports an algorithm module.

    handlers   the handler contract: ServerHandler, ClientHandler, their contexts, LocalRun
    training   the local training loop (LocalClient, LocalServer) the handlers build on
    params     parameter declarations: Opt, opt(), the Params mixin
    metrics    head_metrics: accuracy/loss, or pixel accuracy/mIoU, of a model's head
    protos     prototype maths: local prototypes, the fold, prototype classifiers
    merge      merge rules: how a relay (or secure aggregation) sums updates in transit
    weights    weight trees: averaging, specs, deltas
    split      which weights are shared and which stay local (FedPer, FedRep, LG-FedAvg)
    robust     robust aggregation rules (median, trimmed mean, Krum)
    dp_sgd     DP-SGD local training (privacy.dp = "sgd", Opacus)

Kept free of imports so that reading one declaration (the config layer reads params) does
not import torch.
"""
