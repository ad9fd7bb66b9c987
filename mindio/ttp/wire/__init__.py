"""The control plane between them: the wire format, the sockets and the sessions."""
