"""Wire protocols: thin adapters that decode a request, call the data plane and encode the answer."""
