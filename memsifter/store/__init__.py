"""Where outputs live: URIs (local or s3://), atomic publication with a _SUCCESS manifest, leases."""
