#!/usr/bin/env bash
# A real HDFS for the HDFS/WebHDFS tests: Hadoop's MiniDFSCluster (org.apache.hadoop:
# hadoop-client-minicluster, pinned in tests/hdfs/pom.xml) around our launcher tests/hdfs/MiniHdfs.java.
# Maven resolves the jars (~105 MB) into the repo's git-ignored .work/m2; javac compiles the
# launcher into .work/hdfs/. Both are redone only when the pom or the launcher change.
set -euo pipefail
cd "$(dirname "$0")/../.."
need=()
command -v javac >/dev/null || need+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null || need+=(maven)
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
fi
out=.work/hdfs
stamp=$(cat tests/hdfs/pom.xml tests/hdfs/MiniHdfs.java | sha256sum | cut -c1-16)
if [[ -f $out/stamp && $(cat $out/stamp) == "$stamp" && -f $out/classes/MiniHdfs.class ]]; then
  exit 0
fi
mkdir -p $out
start=$(date +%s)
mvn -B -q -Dmaven.repo.local="$PWD/.work/m2" -f tests/hdfs/pom.xml dependency:build-classpath \
  -Dmdep.outputFile="$PWD/$out/classpath.txt" >$out/mvn.log 2>&1 || { cat $out/mvn.log >&2; exit 1; }
rm -rf $out/classes
javac -nowarn -d $out/classes -cp "$(cat $out/classpath.txt)" tests/hdfs/MiniHdfs.java
echo "$stamp" >$out/stamp
echo "hdfs: mini cluster ready in $(($(date +%s) - start)) s (maven + javac)"
