"""RayMQ's broker layer (``raymq.actors``): the actor classes and their components.

Plain classes, no Ray import: ``raymq.deploy`` makes them actors at the edge.
Imports only itself and ``raymq.storage``; the client re-exports what users need.
"""
