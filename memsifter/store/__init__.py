"""Where outputs live: URIs (local or s3://) and file I/O (backends), atomic publication with a _SUCCESS
manifest (publication; storage is the namespace both are used through), leases, the fault points where a
crash matters (hooks) and what a running stage records for `memsifter status` (records)."""
