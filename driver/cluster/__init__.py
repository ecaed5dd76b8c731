"""The embedded cluster: a test double of Kubernetes for the demo, the tests and the benchmarks.

- ``apiserver``: the API server emulator (a package of its own);
- ``controllers``: stand-ins for the kube-controller-manager controllers the demo needs (claims from
  templates, Deployments, Jobs, garbage collection, namespaces);
- ``kubelet``: a kubelet simulator (plugin registration and the DRA calls, over real sockets).

The product (agent, controller, allocator, inventory, ``driver.kube``) never imports it;
``tests/test_layers.py`` checks that. It needs the ``demo`` extra (``pip install
'fractional-dra[demo]'``) for the official schemas it validates with.
"""
