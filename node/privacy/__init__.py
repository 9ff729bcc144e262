"""Privacy in the round: secure aggregation (secagg: the cryptography; secure_round: the
protocol's state in the engine, relay and client), differential privacy (dp: the
mechanisms and the accountant; budget: the run's privacy ledger and noise seed) and the
client-side protection of prototypes (prototypes: clipping, noise, withheld counts).
SECURITY.md section 3 states the threat model.
"""
from fedbus.node.privacy.prototypes import PROTOTYPE_KEYS, protect  # noqa: F401
# (protect and PROTOTYPE_KEYS were fedbus.node.privacy's before it became this package)
