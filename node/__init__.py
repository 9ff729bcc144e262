"""The processes and the round: the engine (a deterministic state machine), the server,
the client host and its pool, the relay, validation of what arrives, the config schema,
privacy (fedbus.node.privacy) and the data (fedbus.node.data)."""
from fedbus.algorithms.core.moved import alias_moved

# module names from before the analysis tools and the run's files left node/ (issue 24)
alias_moved("fedbus.node", {
    "plots": ("fedbus.analysis.plots",),
    "replay": ("fedbus.analysis.replay",),
    "ffd": ("fedbus.analysis.ffd",),
    "rundir": ("fedbus.record.rundir",),
    "msglog": ("fedbus.record.msglog",),
    "tensorboard": ("fedbus.record.tensorboard",),
    "dp": ("fedbus.node.privacy.dp",),
    "budget": ("fedbus.node.privacy.budget",),
    "secagg": ("fedbus.node.privacy.secagg",),
    "secure_round": ("fedbus.node.privacy.secure_round",),
})
