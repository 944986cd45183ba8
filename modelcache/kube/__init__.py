"""Kubernetes layer: typed CRD objects, a thin client, and a small controller runtime.

This package (with ``agent/`` and ``coordinator/``) is the only code that imports the
``kubernetes`` client; the core library never does. ``types`` and ``codec`` are plain Python
so callers can build and read our objects without a cluster.

Modules, one job each:

* ``types``      dataclasses for LocalModelCache / LocalModelNamespaceCache / LocalModelNode /
                 LocalModelNodeGroup / ClusterStorageContainer, KServe's enums and label names
* ``client``     ``load_api_client(kubeconfig)`` and ``Kube``: dict CRUD for any ``Resource``
* ``informer``   list+watch into a thread-safe ``Store`` with indexes, resume, relist on 410
* ``workqueue``  de-duplicating queue, one worker per key, delayed and backoff requeue
* ``controller`` ``Controller`` (informers -> queue -> N workers -> reconcile) and ``Manager``
* ``predicates`` which events wake a controller: ``on_update(views...)``, ``event_in``, ``any_of``
* ``objects``    ``meta(obj)``, a typed view of any object's metadata, and ``namespaced_key``
* ``views``      read views of LocalModelNode, the caches and Node (``LocalModelNodeView``, ...)
* ``leader``     ``LeaderElector`` on a coordination.k8s.io/v1 Lease
* ``status``     ``patch_status_if_changed`` / ``update_if_changed``: write on change, retry 409
* ``events``     ``EventRecorder`` for core/v1 Events

Typical use (the agent watching its own LocalModelNode)::

    kube = Kube(load_api_client(args.kubeconfig))
    nodes = Informer(kube, LOCAL_MODEL_NODES, field_selector=f"metadata.name={node_name}")
    ctl = Controller("agent", reconcile, workers=1).watch(nodes, predicate=generation_or_meta_changed)
    manager = Manager(); manager.add(ctl); manager.run(stop_event)

    def reconcile(key: str) -> Result:
        obj = nodes.store.get(key)          # from the cache: no API read
        lmn = LocalModelNodeView(obj)       # read in place: lmn.entries, lmn.model_status, lmn.meta.labels
        ...
        patch_status_if_changed(kube, LOCAL_MODEL_NODES, key, lambda o: new_status, current=obj)
        return Result(requeue_after=60)
"""
