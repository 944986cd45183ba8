from modelcache.cli import main

main()
