import java.io.IOException;
import java.io.InputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.DFSConfigKeys;
import org.apache.hadoop.hdfs.HdfsConfiguration;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.hdfs.server.datanode.DataNode;
import org.apache.hadoop.security.UserGroupInformation;

/**
 * A real HDFS for the tests (tests/fixtures/hdfs.py): one NameNode and one DataNode in this JVM
 * (Hadoop's MiniDFSCluster), WebHDFS on the NameNode's HTTP port, everything on 127.0.0.1.
 *
 * <pre>
 * java -cp CLASSPATH:. MiniHdfs --base DIR --ready FILE [--conf key=value ...]
 * </pre>
 *
 * When the cluster is up, FILE gets one line of JSON with its addresses (written to a temp file
 * and renamed, so a reader never sees half of it). The cluster stops when standard input closes:
 * the fixture holds the pipe, so a test run killed with -9 does not leave a JVM behind.
 * {@code --conf} sets any Hadoop key; the Kerberos set-up is only such keys (see the fixture).
 */
public final class MiniHdfs {
  private MiniHdfs() {}

  public static void main(String[] args) throws Exception {
    String base = null;
    String ready = null;
    Configuration conf = new HdfsConfiguration();
    // Small blocks, so a test file of a few MiB spans several blocks (the checksum is per block).
    conf.setLong(DFSConfigKeys.DFS_BLOCK_SIZE_KEY, 1 << 20);
    conf.setLong(DFSConfigKeys.DFS_NAMENODE_MIN_BLOCK_SIZE_KEY, 0);
    conf.setInt(DFSConfigKeys.DFS_REPLICATION_KEY, 1);
    conf.setBoolean("dfs.webhdfs.enabled", true);
    conf.setBoolean(DFSConfigKeys.DFS_PERMISSIONS_ENABLED_KEY, true);
    for (int i = 0; i < args.length; i++) {
      switch (args[i]) {
        case "--base":
          base = args[++i];
          break;
        case "--ready":
          ready = args[++i];
          break;
        case "--conf":
          String kv = args[++i];
          int eq = kv.indexOf('=');
          if (eq <= 0) {
            throw new IllegalArgumentException("--conf wants key=value, got " + kv);
          }
          conf.set(kv.substring(0, eq), kv.substring(eq + 1));
          break;
        default:
          throw new IllegalArgumentException("unknown argument " + args[i]);
      }
    }
    if (base == null || ready == null) {
      throw new IllegalArgumentException("usage: MiniHdfs --base DIR --ready FILE [--conf key=value ...]");
    }
    conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, base);
    if ("kerberos".equals(conf.get("hadoop.security.authentication"))) {
      // The daemons log in from their keytab; the same identity starts them here.
      UserGroupInformation.setConfiguration(conf);
      UserGroupInformation.loginUserFromKeytab(
          conf.get(DFSConfigKeys.DFS_NAMENODE_KERBEROS_PRINCIPAL_KEY),
          conf.get(DFSConfigKeys.DFS_NAMENODE_KEYTAB_FILE_KEY));
    }
    MiniDFSCluster cluster = new MiniDFSCluster.Builder(conf).numDataNodes(1).build();
    Runtime.getRuntime().addShutdownHook(new Thread(cluster::shutdown));
    cluster.waitActive();
    cluster.waitClusterUp();

    InetSocketAddress http = cluster.getNameNode().getHttpAddress();
    InetSocketAddress rpc = cluster.getNameNode().getNameNodeAddress();
    DataNode dn = cluster.getDataNodes().get(0);
    String json = String.format(
        "{\"namenode_http\": \"%s:%d\", \"namenode_rpc\": \"%s:%d\", \"datanode_http\": \"%s\", \"pid\": %d}%n",
        http.getHostString(), http.getPort(), rpc.getHostString(), rpc.getPort(),
        dn.getInfoPort() > 0 ? "127.0.0.1:" + dn.getInfoPort() : "",
        ProcessHandle.current().pid());
    Path tmp = Paths.get(ready + ".tmp");
    Files.write(tmp, json.getBytes(StandardCharsets.UTF_8));
    Files.move(tmp, Paths.get(ready), StandardCopyOption.ATOMIC_MOVE);
    System.out.println("MiniHdfs ready: " + json.trim());
    System.out.flush();

    waitForEof(System.in);
    System.exit(0); // runs the shutdown hook
  }

  private static void waitForEof(InputStream in) {
    byte[] buf = new byte[256];
    try {
      while (in.read(buf) >= 0) {
        // nothing: the fixture never writes, it only closes
      }
    } catch (IOException e) {
      // a broken pipe means the same as EOF: the fixture is gone
    }
  }
}
