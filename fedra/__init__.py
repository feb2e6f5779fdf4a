"""fedra: federated and geo-distributed training.

Import names: ``fedra.coordinator`` (the daemon), ``fedra.client`` (the site agent),
``fedra.protos`` (the wire contract and tensor codec) and ``fedra.storage``
(persistence) live in the repository's top-level folders of the same names.
"""

__version__ = "0.1.0"
