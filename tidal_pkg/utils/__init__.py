"""Runtime helpers of tidal's processes, beside the contract in tidal.protocol (torch-free):
child processes and signals (process), ports (network), ZeroMQ sockets (zmq_utils) and their
CURVE security (curve), OpenMP threads (openmp), logging (logging_utils), deadlines (deadline).

Dependency direction: frontend, core and worker import these; these import tidal.protocol at
most (envs, config types), never the other way."""
